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
from there: no ``[T, C]`` buffer of ``da``, no second pass over it. (Measured before, on an H200 at 16k
tokens: one pass that recomputed ``da`` at the ``W`` shifted rows in registers, 3.4 ms; two passes through a
bf16 ``da`` buffer, 1.9 ms plus the second pass, and the buffer raised the 64k peak by 0.5 GiB; fla's conv
backward 0.94 ms.)
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

TOKENS_PER_PROGRAM = 256  # backward: tokens one program sums its weight-gradient partials over


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
def _conv_bwd(X, sx, Wc, Bc, STARTS, ENDS, DOUT, DX, sdx, SCRATCH, DW, DB, T, col0, CT, steps, items, heads,
              D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, REP: tl.constexpr, NORM: tl.constexpr,
              HAS_BIAS: tl.constexpr, BT: tl.constexpr, EPS: tl.constexpr):
    """One section's backward. Work item = (a range of ``steps`` token blocks, one head); program ``p`` takes
    items p, p+P, ... (a fixed assignment: the partial sums do not depend on scheduling). Blocks run from the
    range's end backwards, after one extra block (the next range's first, for its first W-1 rows): ``da`` of
    each block goes to this program's two-slot scratch (fp32, L2-resident), so that the shifted rows
    ``da[u+s]`` of ``dx[u]`` come from the current slot or from the previous block's."""
    p = tl.program_id(0)
    nprog = tl.num_programs(0)
    j = tl.arange(0, BT)
    cols = tl.arange(0, D)
    taps = tl.arange(0, WP)
    buf = SCRATCH + p.to(tl.int64) * (2 * BT * D)
    for item in range(p, items, nprog):
        part = item // heads
        h = item % heads
        c = col0 + h * D + cols
        if HAS_BIAS:
            bias = tl.load(Bc + c).to(tl.float32)
        else:
            bias = tl.zeros([D], dtype=tl.float32)
        dw_acc = tl.zeros([WP, BT, D], dtype=tl.float32)  # summed over rows once, at the end
        db_acc = tl.zeros([BT, D], dtype=tl.float32)
        for it in range(steps + 1):
            real = it > 0  # it == 0: the next range's first block, only its da is wanted
            rows = (part * steps + steps - it) * BT + j
            inb = rows < T
            start = tl.load(STARTS + rows, mask=inb, other=0)
            a = tl.zeros([BT, D], dtype=tl.float32) + bias[None, :]
            for s in tl.static_range(W):
                src = rows - s
                x = tl.load(X + src.to(tl.int64)[:, None] * sx + c[None, :], mask=(inb & (src >= start))[:, None],
                            other=0.0)
                a += x.to(tl.float32) * tl.load(Wc + c * W + (W - 1 - s)).to(tl.float32)[None, :]
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
            end = tl.load(ENDS + rows, mask=inb, other=0)
            dx = tl.zeros([BT, D], dtype=tl.float32)
            for s in tl.static_range(W):
                src = rows - s
                x = tl.load(X + src.to(tl.int64)[:, None] * sx + c[None, :],
                            mask=(inb & (src >= start) & real)[:, None], other=0.0)
                dw_acc += tl.where(taps[:, None, None] == (W - 1 - s), (da * x.to(tl.float32))[None, :, :], 0.0)
                ahead = j + s  # row u+s: in this block's slot, or in the previous (later) block's
                at = tl.where(ahead < BT, slot * BT + ahead, (1 - slot) * BT + ahead - BT)
                ok = inb & (rows + s < end) & real
                d = tl.load(buf + at[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
                dx += d * tl.load(Wc + c * W + (W - 1 - s)).to(tl.float32)[None, :]
            tl.store(DX + rows.to(tl.int64)[:, None] * sdx + c[None, :], dx.to(DX.dtype.element_ty),
                     mask=(inb & real)[:, None])
            tl.debug_barrier()  # every read of the other slot is done before the next block overwrites it
        base = part.to(tl.int64) * CT
        tl.store(DW + (base + c[None, :]) * W + taps[:, None], tl.sum(dw_acc, 1), mask=(taps < W)[:, None])
        tl.store(DB + base + c, tl.sum(db_acc, 0))


def _block(d: int) -> int:
    return 16 if d >= 128 else 32


def conv_fwd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, starts: torch.Tensor, out: torch.Tensor,
             col0: int, heads: int, d: int, rep: int, norm: bool, eps: float) -> None:
    """Write ``heads`` heads of ``d`` conv channels from column ``col0`` into ``out`` ``[T, heads*rep, d]``."""
    T = x.shape[0]
    if T == 0 or heads == 0:
        return
    bt = _block(d)
    _conv_fwd[(triton.cdiv(T, bt), heads)](
        x, x.stride(0), w, w if b is None else b, starts, out, T, col0,
        D=d, W=w.shape[1], REP=rep, NORM=norm, HAS_BIAS=b is not None, BT=bt, EPS=eps, num_warps=4)


def conv_bwd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, starts: torch.Tensor, ends: torch.Tensor,
             dout: torch.Tensor, dx: torch.Tensor, dw_part: torch.Tensor, db_part: torch.Tensor,
             col0: int, heads: int, d: int, rep: int, norm: bool, eps: float) -> None:
    """Write ``dx`` for these heads' columns and their weight/bias partial sums (``dw_part`` ``[P, C, W]``,
    ``db_part`` ``[P, C]``, P = ``partials(T)``), in one kernel (see ``_conv_bwd``)."""
    T = x.shape[0]
    if heads == 0:
        return
    bt = _block(d)
    width = w.shape[1]
    items = dw_part.shape[0] * heads
    programs = min(items, _resident(x.device))
    scratch = torch.empty(programs, 2, bt, d, device=x.device, dtype=torch.float32)
    _conv_bwd[(programs,)](
        x, x.stride(0), w, w if b is None else b, starts, ends, dout, dx, dx.stride(0), scratch, dw_part, db_part, T,
        col0, w.shape[0], TOKENS_PER_PROGRAM // bt, items, heads, D=d, W=width, WP=triton.next_power_of_2(width),
        REP=rep, NORM=norm, HAS_BIAS=b is not None, BT=bt, EPS=eps, num_warps=4)


@functools.cache
def _resident(device: torch.device) -> int:
    """How many backward programs run at once: a few per SM on a GPU (each has its own scratch), 2 on the CPU."""
    if device.type != "cuda":
        return 2
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def partials(tokens: int) -> int:
    """How many per-program partial sums the backward writes for a pack of ``tokens`` (at least 1)."""
    return max(1, triton.cdiv(tokens, TOKENS_PER_PROGRAM))
