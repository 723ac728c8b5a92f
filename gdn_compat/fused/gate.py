"""The decay gate and beta of a GatedDeltaNet, forward and backward, in Triton.

    g    = -exp(A_log) * softplus(a + dt_bias)     fp32 throughout (the exp of A_log included)
    beta = sigmoid(b)                              stored in the input's dtype, as the release does

``a`` and ``b`` are columns of the input projection's output ``x`` ``[T, F]``. The formula is 0.18/0.19's
``_compute_g_and_beta`` (upstream PR #2645) as megatron's compiled ``jit_fuser`` evaluates it: inductor
takes the exp of a bf16 ``A_log`` in fp32 without rounding in between. softplus is torch's (threshold 20).
The backward writes ``da``/``db`` into their columns of ``dx`` and per-program partial sums for ``dA_log``
and ``dt_bias`` (no atomics; summed afterwards by ``torch.sum``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TOKENS_PER_PROGRAM = 256


@triton.jit
def _softplus(x):
    e = tl.exp(-tl.abs(x))
    tail = tl.where(e < 1e-4, e - 0.5 * e * e, tl.log(1.0 + e))  # log1p(e) without log1p
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tail)


@triton.jit
def _gate_fwd(X, sx, A_LOG, DT_BIAS, G, BETA, T, a_col, b_col, H: tl.constexpr, BH: tl.constexpr,
              BT: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    heads = tl.arange(0, BH)
    ok = (rows < T)[:, None] & (heads < H)[None, :]
    at = X + rows.to(tl.int64)[:, None] * sx + heads[None, :]
    a = tl.load(at + a_col, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(at + b_col, mask=ok, other=0.0).to(tl.float32)
    a_log = tl.load(A_LOG + heads, mask=heads < H, other=0.0).to(tl.float32)
    dt = tl.load(DT_BIAS + heads, mask=heads < H, other=0.0).to(tl.float32)
    g = -tl.exp(a_log)[None, :] * _softplus(a + dt[None, :])
    out = rows.to(tl.int64)[:, None] * H + heads[None, :]
    tl.store(G + out, g, mask=ok)
    tl.store(BETA + out, tl.sigmoid(b).to(BETA.dtype.element_ty), mask=ok)


@triton.jit
def _gate_bwd(X, sx, A_LOG, DT_BIAS, DG, DBETA, DX, sdx, DA_PART, DDT_PART, T, a_col, b_col, steps,
              H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr):
    pid = tl.program_id(0)
    heads = tl.arange(0, BH)
    hmask = heads < H
    a_log = tl.load(A_LOG + heads, mask=hmask, other=0.0).to(tl.float32)
    dt = tl.load(DT_BIAS + heads, mask=hmask, other=0.0).to(tl.float32)
    decay = tl.exp(a_log)
    da_log = tl.zeros([BH], dtype=tl.float32)
    ddt = tl.zeros([BH], dtype=tl.float32)
    for i in range(steps):
        rows = (pid * steps + i) * BT + tl.arange(0, BT)
        ok = (rows < T)[:, None] & hmask[None, :]
        at = X + rows.to(tl.int64)[:, None] * sx + heads[None, :]
        z = tl.load(at + a_col, mask=ok, other=0.0).to(tl.float32) + dt[None, :]
        b = tl.load(at + b_col, mask=ok, other=0.0).to(tl.float32)
        grad = rows.to(tl.int64)[:, None] * H + heads[None, :]
        dg = tl.load(DG + grad, mask=ok, other=0.0).to(tl.float32)
        dbeta = tl.load(DBETA + grad, mask=ok, other=0.0).to(tl.float32)
        sp = _softplus(z)
        da = tl.where(z > 20.0, 1.0, tl.sigmoid(z)) * (-decay[None, :]) * dg  # d softplus = sigmoid
        da = tl.where(ok, da, 0.0)
        da_log += tl.sum(tl.where(ok, -decay[None, :] * sp * dg, 0.0), 0)  # dg/dA_log = g
        ddt += tl.sum(da, 0)
        beta = tl.sigmoid(b)
        db = dbeta * beta * (1.0 - beta)
        dst = DX + rows.to(tl.int64)[:, None] * sdx + heads[None, :]
        tl.store(dst + a_col, da.to(DX.dtype.element_ty), mask=ok)
        tl.store(dst + b_col, db.to(DX.dtype.element_ty), mask=ok)
    tl.store(DA_PART + pid * H + heads, da_log, mask=hmask)
    tl.store(DDT_PART + pid * H + heads, ddt, mask=hmask)


def gate_fwd(x: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, a_col: int, b_col: int,
             heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(g fp32 ``[T, H]``, beta ``[T, H]`` in x's dtype)."""
    T = x.shape[0]
    g = torch.empty(T, heads, device=x.device, dtype=torch.float32)
    beta = torch.empty(T, heads, device=x.device, dtype=x.dtype)
    if T:
        bt = 64
        _gate_fwd[(triton.cdiv(T, bt),)](x, x.stride(0), a_log, dt_bias, g, beta, T, a_col, b_col, H=heads,
                                         BH=triton.next_power_of_2(heads), BT=bt, num_warps=4)
    return g, beta


def gate_bwd(x: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, dg: torch.Tensor, dbeta: torch.Tensor,
             dx: torch.Tensor, a_col: int, b_col: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes da, db into ``dx``'s columns; returns (dA_log, ddt_bias) in fp32."""
    T = x.shape[0]
    bt = 64
    steps = min(TOKENS_PER_PROGRAM // bt, max(1, triton.cdiv(T, bt)))  # a short pack: its own blocks only
    parts = max(1, triton.cdiv(T, TOKENS_PER_PROGRAM))
    da_part = torch.empty(parts, heads, device=x.device, dtype=torch.float32)
    ddt_part = torch.empty_like(da_part)
    _gate_bwd[(parts,)](x, x.stride(0), a_log, dt_bias, dg.contiguous(), dbeta.contiguous(), dx, dx.stride(0),
                        da_part, ddt_part, T, a_col, b_col, steps, H=heads, BH=triton.next_power_of_2(heads),
                        BT=bt, num_warps=4)
    return da_part.sum(0), ddt_part.sum(0)
