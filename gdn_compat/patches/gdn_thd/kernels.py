"""The packed GDN core: fla's varlen kernels on CUDA, pure torch on the CPU.

In ``deterministic_mode`` the fla kernels run too when the probe found the fla code they reach free of
atomics and scatter-adds (``Facts.fla_atomic_free``): then each kernel sums in an order fixed by its
launch configuration, and fla caches its autotuning choices, so a step repeats bit for bit (measured
on an H200: README, "Deterministic packed GDN"). Otherwise deterministic mode takes the pure-torch core,
one sequence at a time, as the release itself does for unpacked input.

``Core`` is built once per ``apply()`` with the release module and the probed fla signatures; the
forward hands it the layer, this rank's share of the parameters (``Local``) and the pack. fla gets the
pack's chunk indices (``Pack.chunks``) rather than host offsets, for a host pack and a graph-safe device
pack alike: fla-core >= 0.6 takes them in its public ``chunk_gated_delta_rule``; for 0.4.x, whose public
function builds them on the host (``.tolist()``), ``_Rule`` calls fla's own forward and backward, which
take them, in the order fla's autograd Function does.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

from gdn_compat._autograd import once_differentiable
from gdn_compat._probe import Accepts, Varlen
from gdn_compat.patches.gdn_thd import context_parallel as cpx
from gdn_compat.patches.gdn_thd import fast, own
from gdn_compat.patches.gdn_thd.fast import Fast
from gdn_compat.patches.gdn_thd.pack import Pack, host_pack


class _Rule(torch.autograd.Function):
    """fla 0.4.x's ``chunk_gated_delta_rule`` (no initial or final state, q/k already normalised) with
    the chunk indices handed in: the same calls as fla's ``ChunkGatedDeltaRuleFunction``, whose public
    entry would build the indices on the host."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, cu, chunks, fwd, bwd):  # type: ignore[override]
        g, o, A, *_ = fwd(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=None, output_final_state=False,
                          cu_seqlens=cu, chunk_indices=chunks)
        ctx.save_for_backward(q, k, v, g, beta, A, cu, chunks)
        ctx.scale, ctx.bwd = scale, bwd
        return o.to(q.dtype)

    @staticmethod
    @once_differentiable("fla's chunked delta rule as gdn_compat calls it (with the pack's chunk indices)")
    def backward(ctx, do):  # type: ignore[override]
        q, k, v, g, beta, A, cu, chunks = ctx.saved_tensors
        dq, dk, dv, db, dg, _ = ctx.bwd(q=q, k=k, v=v, g=g, beta=beta, A=A, scale=ctx.scale, initial_state=None,
                                        do=do.contiguous(), dht=None, cu_seqlens=cu, chunk_indices=chunks)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta), None, None, None, None, None


def l2norm_torch(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm in plain torch: x / sqrt(sum(x^2) + eps), computed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def g_and_beta(A_log: torch.Tensor, dt_bias: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor):
    # Same expression as 0.18's GatedDeltaNet._compute_g_and_beta (PR #2645).
    g = -A_log.exp() * F.softplus(alpha.float() + dt_bias)  # in fp32
    return g, beta.sigmoid()


def prepare_qkv(qkv, gate, beta, alpha, seq_len: int, qk_local: int, v_local: int, dk: int, dv: int,
                repeat: int, use_l2norm: bool, l2norm: Any):
    # The steps of 0.18's GatedDeltaNet._prepare_qkv_for_gated_delta_rule (PR #2645): split,
    # reshape, one l2norm over q and k together, split, expand grouped heads, make contiguous.
    query_key, value = torch.split(qkv, [2 * qk_local, v_local], dim=-1)
    query_key = query_key.reshape(1, seq_len, -1, dk)
    value = value.reshape(1, seq_len, -1, dv)
    if use_l2norm:
        query_key = l2norm(query_key.contiguous())
    heads = qk_local // dk
    query, key = torch.split(query_key, [heads, heads], dim=2)
    if repeat > 1:
        query = query.repeat_interleave(repeat, dim=2)
        key = key.repeat_interleave(repeat, dim=2)
    return (query.contiguous(), key.contiguous(), value.contiguous(), gate.contiguous(),
            beta.contiguous(), alpha.contiguous())


def _spans(pack: Pack) -> tuple[tuple[int, int], ...]:
    """The pack's non-empty sequences, for the per-sequence torch core."""
    if pack.cu_cpu is not None:
        return pack.spans
    if pack.cu.is_cuda:  # a device pack: its offsets are host memory only on the CPU
        raise RuntimeError("gdn_compat THD: this packed GDN call runs the per-sequence torch core "
                           "(deterministic_mode with fla kernels that use atomics), which reads the offsets "
                           "on the host: it cannot be captured in a CUDA graph")
    bounds = pack.cu.tolist()
    return tuple((a, b) for a, b in zip(bounds, bounds[1:]) if b > a)


@functools.cache
def _fused(shape: tuple[int, ...]) -> tuple[Any, Any]:
    """The two steps compiled for one layer shape (this rank's q/k and v features, head dims, repeat).

    0.18/0.19 run both steps through megatron's jit_fuser (torch.compile), and torch.compile changes how fla's
    l2norm kernel is launched; so do we, for the same bits as upstream's THD. One compiled copy per layer shape
    (#37): torch.compile keeps its cache and its automatic-dynamic record per function, so in a process with a
    second head count (two models, a teacher and a student) one shared copy would be recompiled with every size
    symbolic, and those kernels were ~8x slower on the H200 (the backward of the q/k/v split at 16k tokens:
    1.08 + 0.89 ms against 0.06 + 0.12). Each copy still goes dynamic in the pack length only, as in a process with
    one model."""
    from megatron.core.jit import jit_fuser

    return jit_fuser(_copy(prepare_qkv, shape)), jit_fuser(_copy(g_and_beta, shape))


def _copy(fn: Any, shape: tuple[int, ...]) -> Any:
    """``fn`` under a name of its own (a new code object), so torch.compile tracks it apart from other copies."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{'_'.join(map(str, shape))}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


@dataclasses.dataclass(frozen=True)
class Local:
    """This rank's share of the layer: dims after TP and CP, and its slices of the parameters."""

    qk: int  # q (and k) features
    v: int  # v (and gate) features
    dk: int
    dv: int
    repeat: int  # value heads per key head
    conv_w: torch.Tensor
    conv_b: torch.Tensor | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor


def local_view(layer: Any, cp: int, rank: int) -> Local:
    tp, hk, hv = layer.tp_size, layer.num_key_heads, layer.num_value_heads
    if not cpx.heads_divide(layer, cp):
        raise ValueError(f"gdn_compat: GatedDeltaNet heads must divide by tp x cp = {tp} x {cp}; got "
                         f"{hk} key heads and {hv} value heads")
    qk, v = layer.qk_dim // tp, layer.v_dim // tp
    conv_w, conv_b, A_log, dt_bias = layer.conv1d.weight, layer.conv1d.bias, layer.A_log, layer.dt_bias
    if cp > 1:  # keep q, k and v sections aligned: each is cut into cp head groups
        conv_w = cpx.local_heads(conv_w, [qk, qk, v], cp, rank)
        conv_b = None if conv_b is None else cpx.local_heads(conv_b, [qk, qk, v], cp, rank)
        A_log, dt_bias = A_log.chunk(cp)[rank], dt_bias.chunk(cp)[rank]
    return Local(qk // cp, v // cp, layer.key_head_dim, layer.value_head_dim, hv // hk, conv_w, conv_b, A_log, dt_bias)


# Release methods gdn_compat's packed paths compute in their own code instead of calling (0.18/0.19 names; 0.16/0.17
# compute these steps inline in the forward that gdn_thd replaces), and the rule the layer calls (own.RULE). A layer
# whose method is not the release's own (a framework's subclass or in-place replacement: another output-gate
# activation, a clamped decay, another kernel) is not taken by a path that would ignore it (#41, #53). The unfused path
# calls the layer's _apply_gated_norm and _compute_g_and_beta, so it honours replacements of those two.
UNFUSED_OWN = ("_prepare_qkv_for_gated_delta_rule", "_prepare_input_for_gated_delta_rule", "_gated_norm_and_a2a",
               "_resolve_cu_seqlens", own.RULE)
FUSED_OWN = (*UNFUSED_OWN, "_apply_gated_norm", "_compute_g_and_beta", "_compute_gates")


class Core:
    """The two ways to run the packed core, bound to one release module and one fla."""

    def __init__(self, release: Any, varlen: Varlen, atomic_free: Accepts = Accepts.UNKNOWN, paths: Fast = fast.NONE):
        self.release = release  # its torch_chunk_gated_delta_rule and l2norm are read at call time
        # 0.16-0.18 import fla's l2norm into the GDN module; 0.19 into the package's common.py, where
        # its torch_chunk_gated_delta_rule lives
        rule = getattr(release, "torch_chunk_gated_delta_rule", None)
        self.l2norm_home = release if hasattr(release, "l2norm") or rule is None else sys.modules[rule.__module__]
        self.varlen = varlen
        self.fla_deterministic = atomic_free is Accepts.YES
        self.fast = paths  # the opt-in paths (gdn_flashqla, gdn_fused) this core may take
        self.own = own.Own(release)

    def replaced(self, layer: Any, names: tuple[str, ...], what: str) -> str | None:
        """None when the release methods ``names`` ``layer`` would call now are the release's own, else why ``what``
        (a path that computes those steps itself) does not take the layer."""
        found = self.own.replaced(layer, names)
        if not found:
            return None
        return (f"{type(layer).__module__}.{type(layer).__qualname__} overrides {', '.join(found)}, which {what} "
                f"computes itself")

    @staticmethod
    def gate(layer: Any, own: Any) -> Any:
        """The layer's own gate (0.18/0.19's ``_compute_g_and_beta``, or gdn_gate_fp32's replacement of it),
        so packed and unpacked calls compute the same gate; 0.16/0.17 compute it inline: ``own``."""
        return getattr(layer, "_compute_g_and_beta", None) or own

    def rule(self, query, key, value, g, beta, pack: Pack):
        """fla's delta rule over the pack, handed its chunk indices where fla takes them."""
        if self.varlen.rule_chunks is not Accepts.YES and self.varlen.rule_inner is Accepts.YES:
            from fla.ops.gated_delta_rule import chunk as fla_chunk

            return _Rule.apply(query, key, value, g, beta, key.shape[-1] ** -0.5, pack.cu, pack.chunks,
                               fla_chunk.chunk_gated_delta_rule_fwd, fla_chunk.chunk_gated_delta_rule_bwd)
        out, _ = self.rule_from(query, key, value, g, beta, pack, None)
        return out

    def rule_from(self, query, key, value, g, beta, pack: Pack, initial_state):
        """fla's public delta rule over the pack from ``initial_state`` (None: zero): (output, final state, or None
        without an initial state), handed the pack's chunk indices (or host offsets) so that it reads nothing on the
        host."""
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        if self.varlen.rule_chunks is Accepts.YES:
            extra = {"chunk_indices": pack.chunks}
        else:
            extra = self._host({"cu_seqlens_cpu": pack.cu_cpu} if self.varlen.rule_cpu is Accepts.YES else {}, pack,
                               "chunk_gated_delta_rule")
        return chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                      output_final_state=initial_state is not None, use_qk_l2norm_in_kernel=False,
                                      cu_seqlens=pack.cu, **extra)

    def conv(self, layer: Any, loc: Local, qkv, pack: Pack):
        from fla.modules.convolution import causal_conv1d

        if self.varlen.conv_chunks is Accepts.YES:
            extra = {"chunk_indices": pack.chunks}
        else:
            extra = self._host({"cu_seqlens_cpu": pack.cu_cpu} if self.varlen.conv_cpu is Accepts.YES else {},
                               pack, "causal_conv1d")
        out, _ = causal_conv1d(x=qkv, weight=loc.conv_w.squeeze(1), bias=loc.conv_b, activation=layer.activation,
                               initial_state=None, output_final_state=False, cu_seqlens=pack.cu, **extra)
        return out

    @staticmethod
    def _host(extra: dict, pack: Pack, what: str) -> dict:
        if pack.cu_cpu is None:  # a device pack: this fla would read the offsets on the host
            raise RuntimeError(f"gdn_compat THD: the installed fla's {what} takes no chunk_indices, so a packed GDN "
                               f"step cannot be captured in a CUDA graph (nor use a PackBuffer); install "
                               f"fla-core >= 0.4.2")
        return extra

    def __call__(self, layer: Any, loc: Local, qkv, gate, beta, alpha, pack: Pack, total: int):
        """The unfused core: (delta-rule output, gate z) for the split input projection."""
        why = self.replaced(layer, (own.RULE,), "gdn_compat's packed path")
        if why is not None:  # 0.16/0.17: the module's rule replaced (0.18/0.19's routes leave such a layer to the release)
            if layer.config.deterministic_mode:  # the torch core calls the module's torch rule, one sequence at a time
                fast.note("gdn_compat's packed path", why, instead="it calls the layer's rule one sequence at a time")
                return self.torch(layer, loc, qkv, gate, beta, alpha, pack)
            fast.note("gdn_compat's packed path", why, instead="it calls the layer's rule over the pack with cu_seqlens "
                                                               "(as 0.18's native THD calls it)")
            return self.fla(layer, loc, qkv, gate, beta, alpha, pack, total, theirs=self.own.rule_of(layer))
        qla = self._flashqla(layer, loc, qkv, pack)
        if qkv.is_cuda and (self.fla_deterministic or not layer.config.deterministic_mode or qla is None):
            return self.fla(layer, loc, qkv, gate, beta, alpha, pack, total, qla is None)
        return self.torch(layer, loc, qkv, gate, beta, alpha, pack)

    def passes_state(self, pack: Pack) -> bool:
        """Whether this packed CP call passes the delta rule's state between ranks (gdn_cp_state) instead of the
        head all-to-all. A graph-safe pack never gets here at cp > 1: ``pack.device_pack`` refuses it for every CP
        mode (the load-balancing permutation is built on the host), so the slots always come from host offsets."""
        if not self.fast.state_cp:
            return False
        if pack.cu_cpu is None:  # unreachable while device_pack refuses cp > 1; never lay out slots from nothing
            raise RuntimeError("gdn_compat gdn_cp_state: a graph-safe pack reached state passing at cp > 1; its "
                               "ranks' slots need host offsets (please report this)")
        return True

    def state_passing(self, layer: Any, loc: Local, qkv, gate, beta, alpha, pack: Pack, group: Any):
        """gdn_cp_state: (delta-rule output, gate z) of this rank's slots of every sequence, with all of its tensor-
        parallel rank's heads; the conv's halo and the rule's state come from the slots before (``state_cp.py``)."""
        from gdn_compat.patches.gdn_thd import state_cp, state_steps

        key = ("state_cp", group.size(), group.rank(), qkv.device)
        if key not in pack.memo:  # once per pack: this rank's slots, and a pack of them for fla (host pack only)
            slots = state_cp.Slots.of([end - start for start, end in pack.spans], group.size(), group.rank())
            pack.memo[key] = slots, host_pack(slots.cu, qkv.device)
        slots, pieces = pack.memo[key]
        total = qkv.shape[1]
        x = layer.act_fn(state_cp.conv(qkv[0], loc.conv_w, loc.conv_b, slots, group))[None]
        fla = qkv.is_cuda and (self.fla_deterministic or not layer.config.deterministic_mode)
        query, key, value, gate, beta, alpha = prepare_qkv(
            x, gate, beta, alpha, total, loc.qk, loc.v, loc.dk, loc.dv, loc.repeat, bool(layer.use_qk_l2norm),
            self.l2norm_home.l2norm if fla else l2norm_torch,
        )
        g, beta = self.gate(layer, g_and_beta)(loc.A_log, loc.dt_bias, alpha, beta)
        if self.fast.flashqla:
            fast.note("gdn_flashqla", "context parallelism that passes the state (gdn_cp_state) runs its own rule: "
                                      "fla's chunk steps (fla-core 0.4.2), else one pass of fla's or the release's "
                                      "(from [0, I], corrected by the chained states)")
        if fla and self.varlen.state_steps is Accepts.YES:  # fla-core 0.4.2: the transitions apart from the rule
            steps = state_steps.FlaSteps(pieces, key.shape[-1] ** -0.5)
            return state_steps.delta_rule(steps, query, key, value, g, beta, slots, group), gate
        if fla:
            fast.note("gdn_cp_state's steps with fla-core 0.4.2", "the installed fla's chunk steps are not in "
                      "fla-core 0.4.2's shape (`python -m gdn_compat doctor -v` says why)",
                      instead="gdn_cp_state runs the delta rule once K + V wide through fla's public entry instead "
                              "(the same result, about twice the compute)", quiet=True)

            def rule(q, k, v, g, beta, initial_state, cu):  # cu: the pieces' offsets, which ``pieces`` holds
                return self.rule_from(q, k, v, g, beta, pieces, initial_state)
        else:  # the CPU, or deterministic_mode with fla kernels that use atomics: the release's torch rule
            rule = state_cp.per_slot(self.release.torch_chunk_gated_delta_rule)
        return state_cp.delta_rule(rule, query, key, value, g, beta, slots, group), gate

    def _flashqla(self, layer: Any, loc: Local, x: torch.Tensor, pack: Pack) -> str | None:
        why = fast.flashqla_skip(self.fast, layer, loc, x, pack)
        if why not in (None, "off"):
            fast.note("gdn_flashqla", str(why))
        return why

    def fla(self, layer: Any, loc: Local, qkv, gate, beta, alpha, pack: Pack, total: int, flashqla: bool = False,
            theirs: Any = None):
        """The core over the whole pack: fla's conv, then fla's rule, FlashQLA's (``flashqla``) or the layer's own
        replacement of the release's rule (``theirs``)."""
        if layer.activation not in ("silu", "swish"):
            raise ValueError(f"gdn_compat THD: fla's causal_conv1d supports silu/swish, got activation "
                             f"{layer.activation!r}")
        qkv = self.conv(layer, loc, qkv, pack)
        repeat = 1 if flashqla else loc.repeat
        prepare, gb = _fused((loc.qk, loc.v, loc.dk, loc.dv, repeat))
        query, key, value, gate, beta, alpha = prepare(
            qkv, gate, beta, alpha, total, loc.qk, loc.v, loc.dk, loc.dv, repeat, bool(layer.use_qk_l2norm),
            self.l2norm_home.l2norm,
        )
        g, beta = self.gate(layer, gb)(loc.A_log, loc.dt_bias, alpha, beta)
        if theirs is not None:
            out, _ = theirs(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=False, cu_seqlens=pack.cu)
            return out, gate
        rule = fast.flashqla_rule if flashqla else self.rule
        return rule(query, key, value, g, beta, pack), gate

    def region_core(self, layer: Any, loc: Local, x: torch.Tensor, pack: Pack) -> tuple[Any, str | None]:
        """(the delta-rule core of a fused region call, None) or (None, why this call cannot take the fused
        region); the region's own conditions are ``fast.fused_skip``'s."""
        why = fast.fused_skip(self.fast, layer, loc, x)
        if why is not None:
            return None, why
        why = self.replaced(layer, FUSED_OWN, "the fused region")
        if why is not None:
            return None, why
        from gdn_compat.fused import cores

        if self._flashqla(layer, loc, x, pack) is None:
            return cores.FlashQlaCore(fast.flashqla(), fast.flashqla_cu(pack), fast.cp_context(pack, loc.v // loc.dv)), None
        if not x.is_cuda:  # Triton's interpreter on the CPU: the release's torch rule, one sequence at a time
            return cores.TorchCore(self.release.torch_chunk_gated_delta_rule, _spans(pack)), None
        if layer.config.deterministic_mode and not self.fla_deterministic:
            return None, "deterministic_mode, and the installed fla's delta-rule kernels use atomics"
        if self.varlen.rule_inner is not Accepts.YES:
            return None, (f"the installed fla's chunk_gated_delta_rule_fwd/_bwd do not take the region's arguments "
                          f"({self.varlen.rule_inner})")
        from fla.ops.gated_delta_rule import chunk as fla_chunk

        assert pack.chunks is not None  # every pack carries its chunk indices
        return cores.FlaCore(fla_chunk.chunk_gated_delta_rule_fwd, fla_chunk.chunk_gated_delta_rule_bwd, pack.cu,
                             pack.chunks), None

    def region(self, layer: Any, loc: Local, x: torch.Tensor, pack: Pack, core: Any) -> torch.Tensor:
        """gdn_compat's fused region over ``x`` ``[T, F]`` (the input projection's output): ``[T, v]``, the
        output projection's input."""
        from gdn_compat.fused.region import Spec, region, token_bounds

        found = fast.out_norm(layer)
        assert not isinstance(found, str), found  # fused_skip checked it
        weight, eps, zero_centered = found
        spec = Spec(hk=loc.qk // loc.dk, hv=loc.v // loc.dv, dk=loc.dk, dv=loc.dv, l2norm=bool(layer.use_qk_l2norm),
                    norm_eps=fast.norm_eps(eps, x.dtype), zero_centered=zero_centered, core=core)
        key = ("token_bounds", x.shape[0])
        bounds = pack.memo.get(key) if pack.cu_cpu is not None else None  # a device pack is never cached
        if bounds is None:
            bounds = token_bounds(pack.cu, x.shape[0])
            if pack.cu_cpu is not None:
                pack.memo[key] = bounds
        return region(x, loc.conv_w, loc.conv_b, loc.A_log, loc.dt_bias, weight, bounds, spec)

    def torch(self, layer: Any, loc: Local, qkv, gate, beta, alpha, pack: Pack):
        spans = _spans(pack)
        g, beta = self.gate(layer, g_and_beta)(loc.A_log, loc.dt_bias, alpha, beta)
        outs = []
        width = loc.conv_w.shape[-1]
        for start, end in spans:  # one sequence at a time: state cannot cross a boundary
            length = end - start
            x = qkv[:, start:end].transpose(1, 2).contiguous()  # b, s, d -> b, d, s
            # what the release's nn.Conv1d computes (padding width-1, one group per channel)
            x = F.conv1d(x, loc.conv_w, loc.conv_b, padding=width - 1, groups=loc.conv_w.shape[0])
            x = layer.act_fn(x[..., :length]).transpose(1, 2)
            query, key, value, _, beta_i, g_i = prepare_qkv(
                x, gate, beta[:, start:end], g[:, start:end], length, loc.qk, loc.v, loc.dk, loc.dv, loc.repeat,
                bool(layer.use_qk_l2norm), l2norm_torch,
            )
            out, _ = self.release.torch_chunk_gated_delta_rule(
                query, key, value, g=g_i, beta=beta_i, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False,
            )
            outs.append(out)
        if not outs:
            return qkv.new_zeros(1, 0, loc.v // loc.dv, loc.dv), gate
        return torch.cat(outs, dim=1), gate
