"""The compiled input step of gdn_compat's unfused packed path across layer shapes (#37).

    python -m benchmarks.bench_compile_shapes      (repository root, one GPU, megatron-core and fla-core installed)

gdn_compat's unfused path (0.16/0.17's default packed path; ``gdn_flashqla`` without ``gdn_fused`` on every release)
runs its input step (q/k/v split, l2norm, gate inputs) through megatron's ``jit_fuser`` (torch.compile), forward and
backward. A process that runs a second head count used to recompile one shared copy with its head sizes symbolic;
this script times that step's GPU kernels (torch.profiler, bench_fast's breakdown) at one layer shape when compiled fresh, after another head
count, and after another pack length of the same heads. The first of the three is what a one-model process runs;
the others should match it (they did not before each layer shape got its own copy: 16k tokens of 16 / 32 heads after
an 8 / 16 shard, its six largest compiled kernels took 3.0 ms against 0.38 ms fresh, H200, torch 2.11).
"""

from __future__ import annotations

import torch

SEQUENCES = {  # (tokens, key heads, value heads) in the order one process runs them; the last one is timed
    "fresh": [(16384, 16, 32)],
    "after another head count": [(32768, 8, 16), (16384, 16, 32)],
    "after another pack length": [(32768, 16, 32), (16384, 16, 32)],
}


def step_inputs(tokens: int, hk: int, hv: int, d: int = 128):
    from fla.modules.l2norm import l2norm

    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()

    shape = (hk * d, hv * d, d, d, 1)  # repeat 1: FlashQLA's grouped heads, as gdn_flashqla calls it
    return shape, (rand(1, tokens, (2 * hk + hv) * d), rand(1, tokens, hv, d), rand(1, tokens, hv), rand(1, tokens, hv),
                   tokens, *shape, True, l2norm)


def kernel_ms(tokens: int, hk: int, hv: int, steps: int = 5) -> dict:
    """bench_fast's torch.profiler breakdown of the step (fwd + bwd) at this shape; its first call compiles."""
    from benchmarks.bench_fast import kernels
    from gdn_compat.patches.gdn_thd import kernels as gdn_kernels

    shape, args = step_inputs(tokens, hk, hv)
    prepare, _ = gdn_kernels._fused(shape)

    def step():
        outs = prepare(*args)
        sum(o.float().sum() for o in outs[:3]).backward()

    return kernels(step, steps)


def main() -> None:
    for name, shapes in SEQUENCES.items():
        torch._dynamo.reset()
        for tokens, hk, hv in shapes[:-1]:
            kernel_ms(tokens, hk, hv, steps=1)
        found = kernel_ms(*shapes[-1])
        compiled = [f"{k} {v:.3f}" for k, v in found["top"].items() if k.startswith("triton_")][:4]  # inductor's
        print(f"[compile-shapes] {name:<26} {shapes[-1]}: step kernels {found['total']:.3f} ms (largest compiled: "
              f"{', '.join(compiled)})")


if __name__ == "__main__":
    main()
