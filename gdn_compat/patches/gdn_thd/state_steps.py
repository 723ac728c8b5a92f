"""gdn_cp_state's delta rule with fla-core 0.4.2's chunk steps: the transition apart from the rule (#56).

``state_cp.delta_rule`` runs the rule once per rank ``K + V`` wide through fla's public entry (values ``[v, 0]`` from
``[0, I]``), which carries each token's ``scale P_t^T q_t`` through every kernel of the rule, forward and backward:
on an H100 a rank's share of a 128k document at cp = 4 took ~2.9 / cp of no CP. Here the steps are fla's own, called
in the order its ``chunk_gated_delta_rule_fwd`` / ``_bwd`` call them, with one step inserted where fla's own context
parallelism (fla PR #691, fla.ops.cp, whose layout cannot hold megatron's per-sequence slots) inserts its own:

* forward: the slots' final states ``[B, A]`` from the state recurrence alone (``chunk_gated_delta_rule_fwd_h``,
  values ``[u, 0]`` from ``[0, I]``: no outputs computed), one all_gather, the start states ``S_in`` chained
  (``state_cp.start_states``), then the recurrence and the outputs from ``S_in``, ``V`` wide, as fla runs them;
* backward: ``D``, the gradient a slot's own outputs give its start state (the backward's state recurrence alone,
  ``chunk_gated_delta_rule_bwd_dhu`` with no final-state gradient), one all_gather, each slot's final-state gradient
  chained back from the sequence's last slot (``state_cp.end_grads``), then the rest of fla's backward from ``S_in``
  with that final-state gradient, which gives every input's whole gradient (its outputs' and, through the states
  after it, the later slots'). ``w``, ``u`` and the local ``dv`` of the first pass are reused by the second, so the
  backward recomputes them once, as fla's own does.

``FlaSteps`` is that on the GPU; ``TorchSteps`` runs the same orchestration with a torch rule and autograd (the CPU
tests). Which fla has the steps in that shape: ``gdn_compat._probe.fla.state_steps`` (fla-core 0.4.2; 0.5 and 0.6
scale the gates for exp2 and fuse the steps differently, and keep the one-pass path).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from gdn_compat._autograd import once_differentiable
from gdn_compat._probe.fla import CHUNK_MODULE, STATE_STEPS
from gdn_compat.patches.gdn_thd import state_cp
from gdn_compat.patches.gdn_thd.pack import CHUNK


class _StatePassing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, steps, slots, group):  # type: ignore[override]
        with torch.no_grad():
            ends, cache = steps.ends(q, k, v, g, beta)  # [P, H, K, V + K]: each slot's [B, A]
            every = state_cp.gather(ends, group)  # [cp, P, H, K, V + K]
            B, A = every.split([v.shape[-1], k.shape[-1]], dim=-1)
            A = A.contiguous()
            start = state_cp.start_states(A, B, slots).contiguous()
            o, cache = steps.run(q, k, v, g, beta, start, cache)
        ctx.save_for_backward(q, k, v, g, beta, start, A, *cache)
        ctx.steps, ctx.slots, ctx.group = steps, slots, group
        return o

    @staticmethod
    @once_differentiable("gdn_cp_state's delta rule (fla's chunk steps with the state passed between ranks)")
    def backward(ctx, do):  # type: ignore[override]
        q, k, v, g, beta, start, A, *cache = ctx.saved_tensors
        do = do.contiguous()
        D, cache = ctx.steps.start_grad(q, k, v, g, beta, start, do, cache)  # D: [P, H, K, V]
        final = state_cp.end_grads(A, state_cp.gather(D, ctx.group), ctx.slots).contiguous()
        return (*ctx.steps.grads(q, k, v, g, beta, start, do, final, cache), None, None, None)


def delta_rule(steps: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               slots: state_cp.Slots, group: Any) -> torch.Tensor:
    """As ``state_cp.delta_rule``: this rank's output ``[1, T, H, V]`` of whole sequences of which it holds
    ``slots``, ``q``/``k`` ``[1, T, H, K]`` (repeated to v's heads), ``g``/``beta`` ``[1, T, H]``."""
    if len(slots.cu) == 1:
        return v * 0
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    return _StatePassing.apply(q, k, v, g, beta, steps, slots, group)


class FlaSteps:
    """fla-core 0.4.2's chunk steps over a rank's pieces (``pieces``: their pack, offsets and chunk indices on the
    device), called with the arguments its ``chunk_gated_delta_rule_fwd`` / ``_bwd`` pass them."""

    def __init__(self, pieces: Any, scale: float):
        # the steps the probe checked, looked up on every call's construction: a step replaced on fla's module later
        # (a framework's patch) is the one called
        module = importlib.import_module(CHUNK_MODULE)
        self.f = {name: getattr(module, name) for name in STATE_STEPS}
        self.cu, self.chunks, self.scale = pieces.cu, pieces.chunks, scale

    def _at(self) -> dict[str, Any]:
        return {"cu_seqlens": self.cu, "chunk_indices": self.chunks}

    def ends(self, q, k, v, g, beta):
        f, at = self.f, self._at()
        g = f["chunk_local_cumsum"](g, chunk_size=CHUNK, **at)
        A = f["chunk_scaled_dot_kkt_fwd"](k=k, g=g, beta=beta, output_dtype=torch.float32, **at)
        A = f["solve_tril"](A=A, output_dtype=k.dtype, **at)
        w, u = f["recompute_w_u_fwd"](k=k, v=v, beta=beta, A=A, g=g, **at)
        pieces, heads, dk, dv = self.cu.numel() - 1, v.shape[2], k.shape[-1], v.shape[-1]
        start = torch.zeros(pieces, heads, dk, dv + dk, device=v.device, dtype=torch.float32)
        start[..., dv:] = torch.eye(dk, device=v.device)
        _, _, ends = f["chunk_gated_delta_rule_fwd_h"](k=k, w=w, u=torch.cat([u, u.new_zeros(*u.shape[:-1], dk)], -1),
                                                       g=g, initial_state=start, output_final_state=True,
                                                       save_new_value=False, **at)
        return ends, (g, A, w, u)

    def run(self, q, k, v, g, beta, start, cache):
        f, at = self.f, self._at()
        g, A, w, u = cache
        h, v_new, _ = f["chunk_gated_delta_rule_fwd_h"](k=k, w=w, u=u, g=g, initial_state=start,
                                                        output_final_state=False, **at)
        o = f["chunk_fwd_o"](q=q, k=k, v=v_new, h=h, g=g, scale=self.scale, **at)
        return o.to(q.dtype), (g, A)  # fla's backward recomputes w, u and h from these, as its own Function does

    def start_grad(self, q, k, v, g, beta, start, do, cache):
        f, at = self.f, self._at()
        g, A = cache
        w, u = f["recompute_w_u_fwd"](k=k, v=v, beta=beta, A=A, g=g, **at)
        dv = f["chunk_bwd_dv_local"](q=q, k=k, g=g, do=do, scale=self.scale, **at)
        _, d, _ = f["chunk_gated_delta_rule_bwd_dhu"](q=q, k=k, w=w, g=g, h0=start, dht=None, do=do, dv=dv,
                                                      scale=self.scale, **at)
        return d, (g, A, w, u, dv)

    def grads(self, q, k, v, g, beta, start, do, final, cache):
        # the rest of fla-core 0.4.2's chunk_gated_delta_rule_bwd, in its order, from the first pass's w, u and dv
        f, at = self.f, self._at()
        g_in, (g, A, w, u, dv) = g, cache
        h, v_new, _ = f["chunk_gated_delta_rule_fwd_h"](k=k, w=w, u=u, g=g, initial_state=start,
                                                        output_final_state=False, **at)
        # h0=None: the start state's gradient is not wanted here (D above, chained by end_grads)
        dh, _, dv = f["chunk_gated_delta_rule_bwd_dhu"](q=q, k=k, w=w, g=g, h0=None, dht=final, do=do, dv=dv,
                                                        scale=self.scale, **at)
        dq, dk, dw, dg = f["chunk_bwd_dqkwg"](q=q, k=k, v=v_new, w=w, g=g, h=h, dv=dv, do=do, dh=dh,
                                              scale=self.scale, **at)
        dk2, dv, db, dg2 = f["prepare_wy_repr_bwd"](k=k, v=v, beta=beta, g=g, A=A, dw=dw, du=dv, **at)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = f["chunk_local_cumsum"](dg, chunk_size=CHUNK, reverse=True, **at)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g_in), db.to(beta)


class TorchSteps:
    """The same steps from a torch rule over a rank's pieces (``state_cp.Rule``, e.g. ``state_cp.per_slot`` of the
    release's torch rule) and autograd: the orchestration on the CPU."""

    def __init__(self, rule: state_cp.Rule, slots: state_cp.Slots):
        self.rule, self.slots = rule, slots

    def ends(self, q, k, v, g, beta):
        _, ends = state_cp.local_pass(self.rule, q, k, v, g, beta, self.slots)
        return ends, ()

    def run(self, q, k, v, g, beta, start, cache):
        o, _ = self.rule(q, k, v, g, beta, start, self.slots.cu)
        return o, ()

    def start_grad(self, q, k, v, g, beta, start, do, cache):
        with torch.enable_grad():
            s = start.detach().requires_grad_(True)
            o, _ = self.rule(q, k, v, g, beta, s, self.slots.cu)
            (d,) = torch.autograd.grad(o, s, do)
        return d, ()

    def grads(self, q, k, v, g, beta, start, do, final, cache):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
            o, end = self.rule(*leaves, start, self.slots.cu)
            return torch.autograd.grad([o, end], leaves, [do, final.to(end.dtype)])
