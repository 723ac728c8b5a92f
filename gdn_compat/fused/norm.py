"""GatedDeltaNet's output side: per-head RMSNorm times SiLU of the gate z, forward and backward, in Triton.

    y[t, h, :] = o[t, h, :] * rsqrt(mean(o[t, h, :]^2) + eps) * (w + zc) * silu(z[t, h, :])

``o`` is the delta rule's output ``[T, H, D]``; ``z`` is read straight from its columns of the input
projection's output ``x`` (a strided view, no copy); ``y`` ``[T, H*D]`` is the output projection's
input. Computed in fp32 and rounded once (the release rounds the norm's output, then the product).
The backward recomputes the norm from ``o``: one pass returns ``do`` and, where the region has ``dx`` already,
writes ``dz`` into it; otherwise a second pass writes ``dz`` later. The norm weight's gradient is a per-program
partial sum (no atomics), added up by ``torch.sum``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TOKENS_PER_PROGRAM = 256


@triton.jit
def _norm_fwd(OUT, X, sx, NW, Y, T, z_col, ZC: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
              EPS: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1)
    nh = tl.num_programs(1)
    cols = tl.arange(0, D)
    ok = (rows < T)[:, None]
    at = rows.to(tl.int64)[:, None] * (nh * D) + h * D + cols[None, :]
    o = tl.load(OUT + at, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(X + rows.to(tl.int64)[:, None] * sx + z_col + h * D + cols[None, :], mask=ok, other=0.0)
    z = z.to(tl.float32)
    w = tl.load(NW + cols).to(tl.float32) + ZC
    rstd = tl.rsqrt(tl.sum(o * o, 1) / D + EPS)
    y = o * rstd[:, None] * w[None, :] * (z * tl.sigmoid(z))
    tl.store(Y + at, y.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _norm_bwd(DY, OUT, X, sx, NW, DO, DZ, sdz, DW_PART, T, z_col, steps, ZC: tl.constexpr, D: tl.constexpr,
              BT: tl.constexpr, EPS: tl.constexpr, DO_DW: tl.constexpr, DZ_TOO: tl.constexpr):
    """``do`` and the weight's partial sums (DO_DW), and/or ``dz`` (DZ_TOO) in the same pass. A region whose core's
    backward needs much memory asks for ``dz`` alone after that backward, straight into dx, so that no
    ``[T, H*D]`` buffer of it is alive at the peak; otherwise everything comes from one pass."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    nh = tl.num_programs(1)
    cols = tl.arange(0, D)
    w = tl.load(NW + cols).to(tl.float32) + ZC
    dw = tl.zeros([D], dtype=tl.float32)
    for i in range(steps):
        rows = (pid * steps + i) * BT + tl.arange(0, BT)
        ok = (rows < T)[:, None]
        at = rows.to(tl.int64)[:, None] * (nh * D) + h * D + cols[None, :]
        o = tl.load(OUT + at, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + at, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(X + rows.to(tl.int64)[:, None] * sx + z_col + h * D + cols[None, :], mask=ok, other=0.0)
        z = z.to(tl.float32)
        sig = tl.sigmoid(z)
        act = z * sig
        rstd = tl.rsqrt(tl.sum(o * o, 1) / D + EPS)
        r = o * rstd[:, None]
        nw = r * w[None, :]
        if DZ_TOO:
            dz = dy * nw * sig * (1.0 + z * (1.0 - sig))
            tl.store(DZ + rows.to(tl.int64)[:, None] * sdz + h * D + cols[None, :], dz.to(DZ.dtype.element_ty),
                     mask=ok)
        if DO_DW:
            dw += tl.sum(dy * act * r, 0)
            dr = dy * act * w[None, :]
            do = (dr - r * (tl.sum(dr * r, 1) / D)[:, None]) * rstd[:, None]
            tl.store(DO + at, do.to(DO.dtype.element_ty), mask=ok)
    if DO_DW:
        tl.store(DW_PART + (pid * nh + h).to(tl.int64) * D + cols, dw)


def norm_fwd(o: torch.Tensor, x: torch.Tensor, w: torch.Tensor, z_col: int, eps: float, zc: float) -> torch.Tensor:
    """``o`` ``[T, H, D]`` contiguous -> ``y`` ``[T, H*D]`` in o's dtype."""
    T, heads, d = o.shape
    y = torch.empty(T, heads * d, device=o.device, dtype=o.dtype)
    if T:
        bt = 16
        _norm_fwd[(triton.cdiv(T, bt), heads)](o, x, x.stride(0), w, y, T, z_col, ZC=zc, D=d, BT=bt, EPS=eps,
                                                 num_warps=4)
    return y


def norm_bwd(dy: torch.Tensor, o: torch.Tensor, x: torch.Tensor, w: torch.Tensor, z_col: int, eps: float,
             zc: float, dz: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(do ``[T, H, D]`` in o's dtype, dw fp32 ``[D]``); with ``dz`` (``[T, H*D]``, any row stride) it writes dz
    there in the same pass, else ``norm_dz`` writes it later."""
    T, heads, d = o.shape
    bt = 16
    steps = min(TOKENS_PER_PROGRAM // bt, max(1, triton.cdiv(T, bt)))  # a short pack: its own blocks only
    parts = max(1, triton.cdiv(T, TOKENS_PER_PROGRAM))
    do = torch.empty_like(o)
    dw_part = torch.empty(parts, heads, d, device=o.device, dtype=torch.float32)
    at = do if dz is None else dz
    _norm_bwd[(parts, heads)](dy.contiguous(), o, x, x.stride(0), w, do, at, at.stride(0), dw_part, T, z_col, steps,
                              ZC=zc, D=d, BT=bt, EPS=eps, DO_DW=True, DZ_TOO=dz is not None, num_warps=4)
    return do, dw_part.sum((0, 1))


def norm_dz(dy: torch.Tensor, o: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dz: torch.Tensor, z_col: int,
            eps: float, zc: float) -> None:
    """Writes dz into ``dz`` ``[T, H*D]`` (any row stride: a buffer, or dx's z columns)."""
    T, heads, d = o.shape
    if T == 0:
        return
    bt = 16
    _norm_bwd[(triton.cdiv(T, bt), heads)](dy.contiguous(), o, x, x.stride(0), w, dz, dz, dz.stride(0), dz, T, z_col,
                                           1, ZC=zc, D=d, BT=bt, EPS=eps, DO_DW=False, DZ_TOO=True, num_warps=4)
