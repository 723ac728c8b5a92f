"""Delta-rule cores the fused region (``region.py``) calls between its own kernels, forward and backward.

Each holds one pack's offsets and exposes ``forward(q, k, v, g, beta) -> (o, saved)`` and
``backward(q, k, v, g, beta, saved, do) -> (dq, dk, dv, dg, dbeta)``; ``gva`` says whether it takes q/k
with fewer heads than v (grouped value attention) or needs them repeated, ``lean_backward`` whether its backward
needs so little memory that the region may allocate its input gradient before it.

* ``FlaCore``: fla's own ``chunk_gated_delta_rule_fwd`` / ``_bwd`` (fla-core 0.4.x and >= 0.6 share the
  keywords used here), handed the pack's chunk indices, as fla's autograd Function calls them.
* ``FlashQlaCore``: FlashQLA's ``chunk_gated_delta_rule_fwd`` / ``_bwd`` (flash-qla >= 0.1.3), q/k not
  repeated, its intra-card CP where gdn_compat decided it for a host pack (else ``auto_cp=False``).
* ``TorchCore``: the release's pure-torch ``torch_chunk_gated_delta_rule``, one sequence at a time (CPU).
"""

from __future__ import annotations

from typing import Any

import torch


class FlaCore:
    gva = False
    lean_backward = False  # its chunked backward is the region's memory peak: dx only after it

    def __init__(self, fwd: Any, bwd: Any, cu: torch.Tensor, chunks: torch.Tensor):
        self.fwd, self.bwd, self.cu, self.chunks = fwd, bwd, cu, chunks

    def forward(self, q, k, v, g, beta):
        out = self.fwd(q=q, k=k, v=v, g=g, beta=beta, scale=k.shape[-1] ** -0.5, initial_state=None,
                       output_final_state=False, cu_seqlens=self.cu, chunk_indices=self.chunks)
        g_cum, o, A = out[0], out[1], out[2]
        return o, (g_cum, A)

    def backward(self, q, k, v, g, beta, saved, do):
        g_cum, A = saved
        dq, dk, dv, db, dg = self.bwd(q=q, k=k, v=v, g=g_cum, beta=beta, A=A, scale=k.shape[-1] ** -0.5,
                                      initial_state=None, do=do, dht=None, cu_seqlens=self.cu,
                                      chunk_indices=self.chunks)[:5]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, db  # as fla's autograd Function casts them


class FlashQlaCore:
    gva = True
    lean_backward = True  # H200, one layer at 64k tokens: 6.9 GiB peak with it, 11.3 GiB with fla's

    def __init__(self, module: Any, cu: torch.Tensor, cp: dict[str, Any] | None = None):
        # cp: {"cp_context": the pack's intra-card CP context} or {} (gdn_thd/fast.py: cp_context); the same
        # context for forward and backward, which must agree on the split. Uncached: the backward recomputes the
        # segments' initial states (the region saves tensors only)
        self.fq, self.cu, self.cp = module, cu, cp or {}

    def forward(self, q, k, v, g, beta):
        g_cum, A, o, *_ = self.fq.chunk_gated_delta_rule_fwd(
            q=q, k=k, v=v, g=g, beta=beta, scale=k.shape[-1] ** -0.5, initial_state=None, cu_seqlens=self.cu,
            output_final_state=False, output_h=False, auto_cp=False, **self.cp)
        return o, (g_cum, A)

    def backward(self, q, k, v, g, beta, saved, do):
        g_cum, A = saved
        dq, dk, dv, db, dg, _ = self.fq.chunk_gated_delta_rule_bwd(
            q=q, k=k, v=v, g=g_cum, beta=beta, A=A, do=do, dht=None, scale=k.shape[-1] ** -0.5,
            initial_state=None, cu_seqlens=self.cu, auto_cp=False, **self.cp)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg, db  # as FlashQLA's autograd Function casts them


class TorchCore:
    gva = False
    lean_backward = False  # the CPU tests' core; tests/test_fused_kernels.py runs the region both ways

    def __init__(self, rule: Any, spans: tuple[tuple[int, int], ...]):
        self.rule, self.spans = rule, spans

    def _run(self, q, k, v, g, beta):
        outs = [self.rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], initial_state=None,
                          output_final_state=False, use_qk_l2norm_in_kernel=False)[0] for a, b in self.spans]
        return torch.cat(outs, 1) if outs else v.new_zeros(v.shape)

    def forward(self, q, k, v, g, beta):
        with torch.no_grad():
            return self._run(q, k, v, g, beta), ()

    def backward(self, q, k, v, g, beta, saved, do):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
            o = self._run(*leaves)
            grads = torch.autograd.grad(o, leaves, do.to(o.dtype), allow_unused=True)
        return tuple(torch.zeros_like(t) if d is None else d for t, d in zip(leaves, grads))
