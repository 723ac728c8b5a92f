"""THD forward+backward of one GDN layer at cp = 1 vs cp = 2 (design.md section 5 shapes, each
sequence padded to a multiple of 2 x cp as Megatron's THD load balancing needs), one process per
GPU with NCCL. For the multi-GPU issue; `--cpu-smoke` runs tiny shapes with gloo to check the script.

    python -m benchmarks.bench_gdn_cp            # from the repository root; needs 2 GPUs and megatron-core 0.16/0.17 (+ gdn_compat) or 0.18+
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tests.support.gdn import DESIGN_LENGTHS as LENGTHS
from tests.support.gdn import QWEN3_NEXT as SHAPE
from tests.support.gdn import build_gdn, offsets, packed, shard


def worker(rank: int, port: int, smoke: bool) -> None:
    from tests.support.megatron import world

    with world(rank, 2, cp=2, port=port, cuda=not smoke):
        run(rank, smoke)


def run(rank: int, smoke: bool) -> None:
    import torch.distributed as dist

    import gdn_compat

    gdn_compat.apply()
    device, dtype = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    shape = dict(hidden=32, dk=8, dv=8, hk=4, hv=8) if smoke else SHAPE
    lengths = [8, 16, 8] if smoke else [n + (-n % 4) for n in LENGTHS]
    cu = offsets(lengths)
    torch.manual_seed(0)
    x = torch.randn(cu[-1], 1, shape["hidden"], dtype=dtype)
    from megatron.core import parallel_state

    solo = [dist.new_group([r]) for r in range(2)]  # every rank creates every group
    results, peak = {}, {}
    # one module per cp size: native 0.18+ fixes its cp size at construction
    for cp, group in ((1, solo[rank]), (2, parallel_state.get_context_parallel_group())):
        m = build_gdn(device=device, dtype=dtype, cp_group=group, **shape)
        xl = (x if cp == 1 else shard(x, lengths, 2, rank)).to(device).requires_grad_(True)
        psp = packed(cu)
        psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.to(device)

        def step(m=m, xl=xl, psp=psp):
            m(xl, None, packed_seq_params=psp)[0].sum().backward()

        times = []
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for i in range(7):
            if device == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            ms = 1000 * (time.perf_counter() - t0)
            if i >= 2:
                times.append(ms)
        results[cp] = statistics.median(times)
        peak[cp] = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
    if rank == 0:
        print(f"THD fwd+bwd, {cu[-1]} tokens in {len(lengths)} sequences: cp=1 {results[1]:.2f} ms, "
              f"cp=2 {results[2]:.2f} ms per rank ({results[1] / results[2]:.2f}x); "
              f"peak memory rank 0 cp=1 {peak[1]:.0f} MiB, cp=2 {peak[2]:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    from tests.support.megatron import free_port

    mp.spawn(worker, args=(free_port(), args.cpu_smoke), nprocs=2, join=True)


if __name__ == "__main__":
    main()
