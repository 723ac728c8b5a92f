"""gdn_compat's fused-region kernels alone (#30), at one Qwen3-Next GDN layer's shapes (16 key heads, 32 value heads,
head dims 128, conv width 4, bf16) for a pack of --tokens tokens in 9 sequences: each kernel's time (CUDA events,
median of --steps launches after a warm-up), and what it moves against the H200's ~4.3 TB/s.

    python -m benchmarks.bench_region [--tokens 16384] [--steps 20] [--programs-per-sm 2,4,8]
                                      [--sweep 16x8x4,32x8x2]   (repository root)

The conv backward is timed once per --programs-per-sm value (resident programs per SM; its partial sums do
not depend on it) and per --sweep launch shape (token rows per block x warps x programs per SM), for the q
section (l2norm, q/k repeated twice as fla's core returns them) and the v section; every shape must give the
same dx bitwise and the same weight gradient to 1e-5 (relative, in the 2-norm). The layer bench (bench_fast.py) profiles the same kernels
inside the layer.
"""

from __future__ import annotations

import argparse

import torch


def timed(fn, steps: int) -> float:
    """Median ms of ``steps`` launches after one warm-up (bench_gdn_thd's measure)."""
    if not torch.cuda.is_available():  # a smoke run through Triton's interpreter (TRITON_INTERPRET=1, --device cpu)
        fn()
        return float("nan")
    from benchmarks.bench_gdn_thd import measure

    return measure(fn, steps, warmup=1)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--programs-per-sm", default="2,4,8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sweep", default="", help="more conv-backward launch shapes, ROWSxWARPSxPER_SM,...")
    ap.add_argument("--fwd-sweep", default="", help="conv-forward launch shapes, ROWSxWARPS,...")
    args = ap.parse_args()
    from gdn_compat.fused import conv, gate, norm
    from gdn_compat.fused.region import token_bounds

    T, hk, hv, d, W = args.tokens, 16, 32, 128, 4
    qk, v = hk * d, hv * d
    C, F = 2 * qk + v, 2 * qk + 2 * v + 2 * hv
    dev, bf = args.device, torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(T, F, device=dev, dtype=bf)
    w = torch.randn(C, W, device=dev, dtype=bf) * 0.3
    lengths = [T // 9] * 8 + [T - 8 * (T // 9)]
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(9)], device=dev, dtype=torch.int32)
    starts, ends = token_bounds(cu, T)
    rep = hv // hk
    q = torch.empty(T, hk * rep, d, device=dev, dtype=bf)
    vv = torch.empty(T, hv, d, device=dev, dtype=bf)
    dq, dvv = torch.randn_like(q), torch.randn_like(vv)
    dx = torch.empty_like(x)
    parts = conv.partials(T)
    dw = torch.empty(parts, C, W, device=dev, dtype=torch.float32)
    db = torch.empty(parts, C, device=dev, dtype=torch.float32)
    gbps = lambda nbytes, ms: nbytes / ms / 1e6  # noqa: E731
    rows = []
    fwd_first = None
    for fwd_rows, fwd_warps in [(conv.FWD_ROWS, conv.FWD_WARPS)] + [
            tuple(int(n) for n in one.split("x")) for one in args.fwd_sweep.split(",") if one]:
        conv.FWD_ROWS, conv.FWD_WARPS = fwd_rows, fwd_warps
        shape = f"{fwd_rows} rows x {fwd_warps} warps"
        ms = timed(lambda: conv.conv_fwd(x, w, None, starts, q, 0, hk, d, rep, True, 1e-6), args.steps)
        rows.append((f"conv fwd q (l2norm, x2 repeat; {shape})", ms, T * qk * 2 + q.numel() * 2))
        ms = timed(lambda: conv.conv_fwd(x, w, None, starts, vv, 2 * qk, hv, d, 1, False, 0.0), args.steps)
        rows.append((f"conv fwd v ({shape})", ms, T * v * 2 * 2))
        got = (q.clone(), vv.clone())
        fwd_first = fwd_first or got
        same = torch.equal(got[0], fwd_first[0]) and torch.equal(got[1], fwd_first[1])
        print(f"conv fwd {shape}: {'bitwise the first shape' if same else 'DIFFERS from the first shape'}")
    shapes = [(conv.BWD_ROWS, conv.BWD_WARPS, int(n)) for n in args.programs_per_sm.split(",")]
    if args.sweep:
        shapes += [tuple(int(n) for n in one.split("x")) for one in args.sweep.split(",")]
    first = None
    for rows_, warps, per_sm in shapes:
        conv.BWD_ROWS, conv.BWD_WARPS, conv.PROGRAMS_PER_SM = rows_, warps, per_sm
        shape = f"{rows_} rows x {warps} warps, {per_sm}/SM"
        ms = timed(lambda: conv.conv_bwd(x, w, None, starts, ends, dq, dx, dw, db, 0, hk, d, rep, True, 1e-6),
                   args.steps)
        rows.append((f"conv bwd q ({shape})", ms, T * qk * 2 * 2 + dq.numel() * 2))
        ms = timed(lambda: conv.conv_bwd(x, w, None, starts, ends, dvv, dx, dw, db, 2 * qk, hv, d, 1, False, 0.0),
                   args.steps)
        rows.append((f"conv bwd v ({shape})", ms, T * v * 2 * 3))
        got = (dx[:, 2 * qk:C].clone(), dw[:, 2 * qk:C].sum(0))  # the v section's: the same at every shape
        if first is None:
            first = got
        else:
            assert torch.equal(got[0], first[0]), f"conv bwd dx differs at {shape}"
            off = ((got[1] - first[1]).norm() / first[1].norm()).item()  # the row sums' order follows the layout
            assert off <= 1e-5, f"conv bwd dw differs by {off:.1e} (relative) at {shape}"
            print(f"conv bwd {shape}: dx bitwise, dw {'bitwise' if off == 0 else f'within {off:.1e}'}")
    a_log = torch.randn(hv, device=dev, dtype=bf)
    dt = torch.randn(hv, device=dev, dtype=bf)
    ms = timed(lambda: gate.gate_fwd(x, a_log, dt, 2 * qk + 2 * v + hv, 2 * qk + 2 * v, hv), args.steps)
    rows.append(("gate fwd", ms, T * hv * (2 * 2 + 4 + 2)))
    o = torch.randn(T, hv, d, device=dev, dtype=bf)
    nw = torch.randn(d, device=dev, dtype=bf)
    ms = timed(lambda: norm.norm_fwd(o, x, nw, 2 * qk + v, 1e-6, 0.0), args.steps)
    rows.append(("gated norm fwd", ms, T * v * 2 * 3))
    dy = torch.randn(T, hv * d, device=dev, dtype=bf)
    ms = timed(lambda: norm.norm_bwd(dy.reshape(o.shape), o, x, nw, 2 * qk + v, 1e-6, 0.0), args.steps)
    rows.append(("gated norm bwd (do, dw)", ms, T * v * 2 * 4))
    print(f"fused-region kernels, {T} tokens, {torch.cuda.get_device_name() if dev == 'cuda' else dev}, Triton "
          f"{__import__('triton').__version__}")
    for name, ms, nbytes in rows:
        print(f"  {name:<56} {ms:8.3f} ms  {gbps(nbytes, ms):7.0f} GB/s")


if __name__ == "__main__":
    main()
