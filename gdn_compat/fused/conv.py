"""Varlen causal depthwise conv + SiLU (+ per-head l2norm, + head repeat): forward and backward, in Triton.

The conv of a GatedDeltaNet runs over the first ``C`` columns of the input projection's output ``x``
(``[T, F]``, rows are tokens of a pack). Channel ``c`` of token ``t``::

    a[t, c] = bias[c] + sum_s w[c, W-1-s] * x[t-s, c]     (terms with t-s before t's sequence start are 0)
    u = silu(a);  out = u * rsqrt(sum_head(u^2) + eps)     (q/k heads; v heads: out = u)

``starts[t]`` / ``ends[t]`` are where token ``t``'s sequence starts and ends: the conv restarts there, so
no state crosses a boundary and a zero-length entry anywhere in the offsets costs nothing. One program
handles ``BT`` tokens of one head; sizes come from shapes only (no host read, graph-safe).

The backward recomputes ``a`` (from ``x``, cheap) instead of saving it, and sums in a fixed order with
no atomics: the conv weight and bias gradients are per-program partial sums over a fixed token range,
added up afterwards by ``torch.sum`` (run-to-run bitwise, and the same on any number of SMs). One kernel per
section (q, k, v): ``da`` (the pre-activation gradient, through l2norm and SiLU) stays in fp32 in a two-block
scratch of its program, and ``dx[u] = sum_s w[W-1-s] * da[u+s]`` (``u+s`` in ``u``'s sequence) reads it back
from there, and so does the weight gradient ``dw[W-1-s] += da[u+s] * x[u]``: no ``[T, C]`` buffer of ``da``, no
second pass over it or over ``x``. (H200, 16k tokens, the three sections in the layer: this kernel 0.78 ms at 8 rows
x 2 warps x 8 programs per SM, 0.83 ms at 8 x 4 x 8, 1.11 ms at 16 x 4 x 4; the q and v sections alone 0.25 + 0.41
ms against 0.28 + 0.42 at 8 x 4 x 8, benchmarks/results/h200-region-0.19.2.txt. Before, one pass that recomputed
``da`` at the ``W`` shifted rows in registers, 3.4 ms; two passes through a bf16 ``da`` buffer, 1.9 ms plus the
second pass, and the buffer raised the 64k peak by 0.5 GiB; fla's conv backward 0.94 ms. It is bound by the
latency of each program's chain of blocks, not by traffic: ~0.77 GB, a ~0.18 ms floor.)
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

TOKENS_PER_PROGRAM = 256  # backward: tokens one program sums its weight-gradient partials over
# The backward's launch shape for head dims >= 128 (benchmarks/bench_region.py --sweep times the choices): token
# rows per block, warps per program, programs per SM (each has a 2 x BWD_ROWS x D fp32 scratch). None of them
# changes which tokens a partial sum covers; BWD_ROWS fixes the order of additions inside one.
BWD_ROWS, BWD_WARPS, PROGRAMS_PER_SM = 8, 2, 8


@triton.jit
def _conv_fwd(X, sx, Wc, Bc, STARTS, OUT, T, col0,
              D: tl.constexpr, W: tl.constexpr, REP: tl.constexpr, NORM: tl.constexpr,
              HAS_BIAS: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    nh = tl.num_programs(1)
    rows = pid_t * BT + tl.arange(0, BT)
    cols = tl.arange(0, D)
    inb = rows < T
    start = tl.load(STARTS + rows, mask=inb, other=0)
    c = col0 + h * D + cols
    acc = tl.zeros([BT, D], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bc + c).to(tl.float32)[None, :]
    for s in tl.static_range(W):
        src = rows - s
        ok = inb & (src >= start)
        x = tl.load(X + src.to(tl.int64)[:, None] * sx + c[None, :], mask=ok[:, None], other=0.0)
        w = tl.load(Wc + c * W + (W - 1 - s))
        acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
    y = acc * tl.sigmoid(acc)
    if NORM:
        y = y * tl.rsqrt(tl.sum(y * y, 1) + EPS)[:, None]
    y = y.to(OUT.dtype.element_ty)
    for r in tl.static_range(REP):
        dst = OUT + (rows.to(tl.int64)[:, None] * (nh * REP) + h * REP + r) * D + cols[None, :]
        tl.store(dst, y, mask=inb[:, None])


@triton.jit
def _tap_acc(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, p, S: tl.constexpr):
    """``acc<S> += p`` (``S`` is a constexpr: no select, the other accumulators pass through untouched)."""
    if S == 0:
        acc0 += p
    if S == 1:
        acc1 += p
    if S == 2:
        acc2 += p
    if S == 3:
        acc3 += p
    if S == 4:
        acc4 += p
    if S == 5:
        acc5 += p
    if S == 6:
        acc6 += p
    if S == 7:
        acc7 += p
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _tap_store(DW, base, c, acc, S: tl.constexpr, W: tl.constexpr):
    if S < W:  # tap W-1-S of every channel: sum_u da[u+S] * x[u]
        tl.store(DW + (base + c) * W + (W - 1 - S), tl.sum(acc, 0))


@triton.jit
def _conv_bwd(X, sx, Wc, Bc, STARTS, ENDS, DOUT, DX, sdx, SCRATCH, DW, DB, T, col0, CT, steps, items, heads,
              D: tl.constexpr, W: tl.constexpr, REP: tl.constexpr, NORM: tl.constexpr,
              HAS_BIAS: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr):
    """One section's backward. Work item = (a range of ``steps`` token blocks, one head); program ``p`` takes
    items p, p+P, ... (a fixed assignment: the partial sums do not depend on scheduling). Blocks run from the
    range's end backwards, after one extra block (the next range's first, for its first W-1 rows): ``da`` of
    each block goes to this program's two-slot scratch (fp32, L2-resident), so that the shifted rows
    ``da[u+s]`` come from the current slot or from the previous block's. Each shifted tile serves both
    ``dx[u] += w[W-1-s] * da[u+s]`` and the weight gradient ``dw[W-1-s] += da[u+s] * x[u]`` (the pair (u, u+s)
    counted in the block of u, so once), with one accumulator per tap. (Keeping the previous block's ``da`` in
    registers and shifting with ``tl.gather`` instead gives the same bits but was slower on the H200: 0.42 + 0.66
    ms for the q and v sections at 16k against 0.32 + 0.46 ms through the scratch, both at 8 rows x 4 warps.)"""
    p = tl.program_id(0)
    nprog = tl.num_programs(0)
    j = tl.arange(0, BT)
    cols = tl.arange(0, D)
    buf = SCRATCH + p.to(tl.int64) * (2 * BT * D)
    for item in range(p, items, nprog):
        part = item // heads
        h = item % heads
        c = col0 + h * D + cols
        if HAS_BIAS:
            bias = tl.load(Bc + c).to(tl.float32)
        else:
            bias = tl.zeros([D], dtype=tl.float32)
        zero = tl.zeros([BT, D], dtype=tl.float32)
        dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7 = zero, zero, zero, zero, zero, zero, zero, zero  # summed at the end
        db_acc = tl.zeros([BT, D], dtype=tl.float32)
        for it in range(steps + 1):
            real = it > 0  # it == 0: the next range's first block, only its da is wanted
            rows = (part * steps + steps - it) * BT + j
            inb = rows < T
            start = tl.load(STARTS + rows, mask=inb, other=0)
            end = tl.load(ENDS + rows, mask=inb, other=0)
            x0 = tl.load(X + rows.to(tl.int64)[:, None] * sx + c[None, :], mask=inb[:, None], other=0.0).to(tl.float32)
            a = x0 * tl.load(Wc + c * W + (W - 1)).to(tl.float32)[None, :] + bias[None, :]
            for s in tl.static_range(1, W):
                src = rows - s  # loaded without waiting for start; rows before it are zeroed after
                x = tl.load(X + src.to(tl.int64)[:, None] * sx + c[None, :], mask=(inb & (src >= 0))[:, None],
                            other=0.0)
                x = tl.where((src >= start)[:, None], x.to(tl.float32), 0.0)
                a += x * tl.load(Wc + c * W + (W - 1 - s)).to(tl.float32)[None, :]
            sig = tl.sigmoid(a)
            u = a * sig
            g = tl.zeros([BT, D], dtype=tl.float32)
            for r in tl.static_range(REP):  # the repeated heads' gradients, summed in a fixed order
                at = DOUT + (rows.to(tl.int64)[:, None] * (heads * REP) + h * REP + r) * D + cols[None, :]
                g += tl.load(at, mask=inb[:, None], other=0.0).to(tl.float32)
            if NORM:
                rstd = tl.rsqrt(tl.sum(u * u, 1) + EPS)
                n = u * rstd[:, None]
                g = (g - n * tl.sum(g * n, 1)[:, None]) * rstd[:, None]
            da = tl.where(inb[:, None], g * sig * (1.0 + a * (1.0 - sig)), 0.0)
            slot = it % 2
            tl.store(buf + slot * (BT * D) + j[:, None] * D + cols[None, :], da)
            tl.debug_barrier()  # the slot is read by other threads of this program below
            db_acc += tl.where(real, da, 0.0)
            dx = tl.zeros([BT, D], dtype=tl.float32)
            for s in tl.static_range(W):
                ahead = j + s  # row u+s: in this block's slot, or in the previous (later) block's
                at = tl.where(ahead < BT, slot * BT + ahead, (1 - slot) * BT + ahead - BT)
                ok = inb & (rows + s < end) & real
                d = tl.load(buf + at[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
                dx += d * tl.load(Wc + c * W + (W - 1 - s)).to(tl.float32)[None, :]
                dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7 = _tap_acc(dw0, dw1, dw2, dw3, dw4, dw5, dw6, dw7, d * x0, s)
            tl.store(DX + rows.to(tl.int64)[:, None] * sdx + c[None, :], dx.to(DX.dtype.element_ty),
                     mask=(inb & real)[:, None])
            tl.debug_barrier()  # every read of the other slot is done before the next block overwrites it
        base = part.to(tl.int64) * CT
        _tap_store(DW, base, c, dw0, 0, W)
        _tap_store(DW, base, c, dw1, 1, W)
        _tap_store(DW, base, c, dw2, 2, W)
        _tap_store(DW, base, c, dw3, 3, W)
        _tap_store(DW, base, c, dw4, 4, W)
        _tap_store(DW, base, c, dw5, 5, W)
        _tap_store(DW, base, c, dw6, 6, W)
        _tap_store(DW, base, c, dw7, 7, W)
        tl.store(DB + base + c, tl.sum(db_acc, 0))


FWD_ROWS, FWD_WARPS = 16, 4  # the forward's token rows per program and warps for head dims >= 128


def _block(d: int) -> int:
    return FWD_ROWS if d >= 128 else 32


def conv_fwd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, starts: torch.Tensor, out: torch.Tensor,
             col0: int, heads: int, d: int, rep: int, norm: bool, eps: float) -> None:
    """Write ``heads`` heads of ``d`` conv channels from column ``col0`` into ``out`` ``[T, heads*rep, d]``."""
    T = x.shape[0]
    if T == 0 or heads == 0:
        return
    bt = _block(d)
    _conv_fwd[(triton.cdiv(T, bt), heads)](
        x, x.stride(0), w, w if b is None else b, starts, out, T, col0,
        D=d, W=w.shape[1], REP=rep, NORM=norm, HAS_BIAS=b is not None, BT=bt, EPS=eps,
        num_warps=FWD_WARPS if d >= 128 else 4)


def conv_bwd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, starts: torch.Tensor, ends: torch.Tensor,
             dout: torch.Tensor, dx: torch.Tensor, dw_part: torch.Tensor, db_part: torch.Tensor,
             col0: int, heads: int, d: int, rep: int, norm: bool, eps: float) -> None:
    """Write ``dx`` for these heads' columns and their weight/bias partial sums (``dw_part`` ``[P, C, W]``,
    ``db_part`` ``[P, C]``, P = ``partials(T)``), in one kernel (see ``_conv_bwd``)."""
    T = x.shape[0]
    if heads == 0:
        return
    bt, warps = (BWD_ROWS, BWD_WARPS) if d >= 128 else (_block(d), 4)
    width = w.shape[1]
    items = dw_part.shape[0] * heads
    programs = min(items, _resident(x.device))
    scratch = torch.empty(programs, 2, bt, d, device=x.device, dtype=torch.float32)
    steps = min(TOKENS_PER_PROGRAM // bt, max(1, triton.cdiv(T, bt)))  # a short pack: its own blocks only
    _conv_bwd[(programs,)](
        x, x.stride(0), w, w if b is None else b, starts, ends, dout, dx, dx.stride(0), scratch, dw_part, db_part, T,
        col0, w.shape[0], steps, items, heads, D=d, W=width, REP=rep, NORM=norm,
        HAS_BIAS=b is not None, BT=bt, EPS=eps, num_warps=warps)


@functools.cache
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _resident(device: torch.device) -> int:
    """How many backward programs run at once: a few per SM on a GPU (each has its own scratch), 2 on the CPU."""
    if device.type != "cuda":
        return 2
    return PROGRAMS_PER_SM * _sms(device)


def partials(tokens: int) -> int:
    """How many per-program partial sums the backward writes for a pack of ``tokens`` (at least 1)."""
    return max(1, triton.cdiv(tokens, TOKENS_PER_PROGRAM))
