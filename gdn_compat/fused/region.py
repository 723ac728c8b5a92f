"""The fused GDN region: from the input projection's output to the output projection's input, one autograd Function.

    x [T, F] = in_proj output (q | k | v | z | b | a), rows are the tokens of a pack
      -> conv + SiLU (+ l2norm) per head  (conv.py)     -> q, k, v
      -> g, beta                          (gate.py)
      -> the delta rule                   (a ``core``: fla's, FlashQLA's or a torch one; not ours)
      -> RMSNorm(o) * SiLU(z)             (norm.py)     -> y [T, H*Dv]

Forward saves ``x`` (which the release keeps alive too: its conv, gate and norm all hold views of it),
the core's output ``o`` and what the core itself needs (its chunked gate and WY matrix); q, k, v, g and
beta are recomputed in backward from ``x`` (one cheap kernel pass) instead of being stored. The backward
writes every column of ``dx`` once (conv channels, z, b, a): no zero fill, no concatenation. Where the core's
backward needs much memory (fla's: the region's peak), ``dx`` is allocated only after it and ``dz`` computed
straight into it then (a second, cheap pass of the norm's backward), so that no buffer of ``dz`` is alive across
the core; where it needs little (``lean_backward``: FlashQLA's), ``dx`` comes first and ``dz`` from the norm's one
pass (H200, 16k tokens: 0.25 instead of 0.34 ms; the 64k peak stays far below native's).
Nothing here knows about megatron; ``Spec`` carries the shapes and the core.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from gdn_compat._autograd import once_differentiable
from gdn_compat.fused import conv, gate, norm


class DeltaRule(Protocol):
    """A delta-rule core: ``gva`` when it takes q/k with fewer heads than v (no repeat)."""

    gva: bool

    def forward(self, q, k, v, g, beta) -> tuple[torch.Tensor, tuple]: ...

    def backward(self, q, k, v, g, beta, saved: tuple, do: torch.Tensor) -> tuple: ...

    lean_backward: bool  # its backward needs little memory: the region may allocate dx before it


@dataclasses.dataclass(frozen=True)
class Spec:
    hk: int  # key heads (this rank's)
    hv: int  # value heads
    dk: int
    dv: int
    l2norm: bool  # q/k l2norm (GatedDeltaNet.use_qk_l2norm)
    norm_eps: float  # the output RMSNorm's eps
    zero_centered: bool  # the output RMSNorm's weight is stored as w - 1
    core: Any  # a DeltaRule
    l2norm_eps: float = 1e-6  # fla's l2norm, as megatron calls it

    @property
    def repeat(self) -> int:
        return 1 if self.core.gva else self.hv // self.hk

    def columns(self) -> tuple[int, int, int, int, int]:
        """(k, v, z, b, a) column offsets in x (q starts at 0)."""
        qk, v = self.hk * self.dk, self.hv * self.dv
        return qk, 2 * qk, 2 * qk + v, 2 * qk + 2 * v, 2 * qk + 2 * v + self.hv


def prepare(x: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None, a_log: torch.Tensor,
            dt_bias: torch.Tensor, starts: torch.Tensor, spec: Spec) -> tuple[torch.Tensor, ...]:
    """q, k ``[1, T, hk*repeat, dk]``, v ``[1, T, hv, dv]``, g fp32 and beta ``[1, T, hv]``."""
    T, rep = x.shape[0], spec.repeat
    k_col, v_col, _, b_col, a_col = spec.columns()
    w = conv_w.reshape(conv_w.shape[0], conv_w.shape[-1])
    q = x.new_empty(T, spec.hk * rep, spec.dk)
    k = x.new_empty(T, spec.hk * rep, spec.dk)
    v = x.new_empty(T, spec.hv, spec.dv)
    conv.conv_fwd(x, w, conv_b, starts, q, 0, spec.hk, spec.dk, rep, spec.l2norm, spec.l2norm_eps)
    conv.conv_fwd(x, w, conv_b, starts, k, k_col, spec.hk, spec.dk, rep, spec.l2norm, spec.l2norm_eps)
    conv.conv_fwd(x, w, conv_b, starts, v, v_col, spec.hv, spec.dv, 1, False, 0.0)
    g, beta = gate.gate_fwd(x, a_log, dt_bias, a_col, b_col, spec.hv)
    return q[None], k[None], v[None], g[None], beta[None]


class Region(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, conv_w, conv_b, a_log, dt_bias, norm_w, starts, ends, spec):  # type: ignore[override]
        q, k, v, g, beta = prepare(x, conv_w, conv_b, a_log, dt_bias, starts, spec)
        o, saved = spec.core.forward(q, k, v, g, beta)
        o = o[0].to(x.dtype).contiguous()
        y = norm.norm_fwd(o, x, norm_w, spec.columns()[2], spec.norm_eps, 1.0 if spec.zero_centered else 0.0)
        ctx.save_for_backward(x, conv_w, conv_b, a_log, dt_bias, norm_w, starts, ends, o, *saved)
        ctx.spec = spec
        return y

    @staticmethod
    @once_differentiable("the fused GDN region (gdn_fused)")
    def backward(ctx, dy):  # type: ignore[override]
        x, conv_w, conv_b, a_log, dt_bias, norm_w, starts, ends, o, *saved = ctx.saved_tensors
        spec: Spec = ctx.spec
        T = x.shape[0]
        k_col, v_col, z_col, b_col, a_col = spec.columns()
        zc = 1.0 if spec.zero_centered else 0.0
        dy = dy.reshape(o.shape)
        z_cols = slice(z_col, z_col + spec.hv * spec.dv)
        # a lean core backward: dx before it, dz from the norm's one pass
        dx = torch.empty_like(x) if spec.core.lean_backward else None
        dz = None if dx is None else dx[:, z_cols]
        do, dnorm_w = norm.norm_bwd(dy, o, x, norm_w, z_col, spec.norm_eps, zc, dz=dz)
        q, k, v, g, beta = prepare(x, conv_w, conv_b, a_log, dt_bias, starts, spec)
        dq, dk, dv, dg, dbeta = spec.core.backward(q, k, v, g, beta, tuple(saved), do[None])
        del q, k, v, g, beta, do
        if dx is None:  # after the core's backward, the region's peak; dz (a second pass) goes straight into it
            dx = torch.empty_like(x)
            norm.norm_dz(dy, o, x, norm_w, dx[:, z_cols], z_col, spec.norm_eps, zc)
        w = conv_w.reshape(conv_w.shape[0], conv_w.shape[-1])
        parts = conv.partials(T)
        dw_part = x.new_empty(parts, w.shape[0], w.shape[1], dtype=torch.float32)
        db_part = x.new_empty(parts, w.shape[0], dtype=torch.float32)
        grad_rep = dq.shape[-2] // spec.hk  # the core's q/k heads per key head (summed back)
        for dout, col0, heads, d, r, l2 in ((dq, 0, spec.hk, spec.dk, grad_rep, spec.l2norm),
                                            (dk, k_col, spec.hk, spec.dk, grad_rep, spec.l2norm),
                                            (dv, v_col, spec.hv, spec.dv, 1, False)):
            conv.conv_bwd(x, w, conv_b, starts, ends, dout[0].contiguous(), dx, dw_part, db_part, col0, heads, d,
                          r, l2, spec.l2norm_eps)
        da_log, ddt = gate.gate_bwd(x, a_log, dt_bias, dg[0], dbeta[0], dx, a_col, b_col, spec.hv)
        dconv_w = dw_part.sum(0).reshape(conv_w.shape).to(conv_w.dtype)
        dconv_b = None if conv_b is None else db_part.sum(0).to(conv_b.dtype)
        return (dx, dconv_w, dconv_b, da_log.to(a_log.dtype), ddt.to(dt_bias.dtype), dnorm_w.to(norm_w.dtype),
                None, None, None)


def token_bounds(cu: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, ends) int32 ``[tokens]``: the start and end of each token's sequence in ``cu`` (zero-length
    entries anywhere are fine), with device ops only."""
    bounds = cu.to(torch.int64)
    pos = torch.arange(tokens, device=cu.device)
    seq = torch.searchsorted(bounds[1:].contiguous(), pos, right=True).clamp_(max=max(bounds.numel() - 2, 0))
    return bounds[seq].to(torch.int32), bounds[seq + 1].to(torch.int32)


def region(x: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None, a_log: torch.Tensor,
           dt_bias: torch.Tensor, norm_w: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor],
           spec: Spec) -> torch.Tensor:
    """y ``[T, hv*dv]`` for ``x`` ``[T, F]`` (see the module docstring); ``bounds`` from ``token_bounds``."""
    if x.stride(-1) != 1:
        raise ValueError(f"gdn_compat fused region: x must have unit stride in its last dim, got strides {x.stride()}")
    width = spec.hk * spec.dk * 2 + spec.hv * spec.dv * 2 + spec.hv * 2
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"gdn_compat fused region: x must be [tokens, {width}] for {spec}, got {tuple(x.shape)}")
    return Region.apply(x, conv_w, conv_b, a_log, dt_bias, norm_w, bounds[0], bounds[1], spec)
