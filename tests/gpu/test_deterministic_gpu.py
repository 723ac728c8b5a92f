"""Deterministic packed GDN on an H200 (#15): bf16, Qwen3-Next head shape, the benchmark's 16,384-token
pack. 0.16/0.17 through gdn_thd, 0.18/0.19 through gdn_thd_deterministic (the release asserts there).

In deterministic mode gdn_compat runs fla's varlen kernels when the probe finds them atomic-free; these
tests are the measurement that makes that safe on this stack: five forward+backward runs bitwise equal
(output, input grad, every parameter grad), also under torch.use_deterministic_algorithms(True), and
equal to the non-deterministic THD path of the same weights.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

import gdn_compat
from gdn_compat._probe import Accepts
from tests.support.gdn import DESIGN_LENGTHS, QWEN3_NEXT, build_gdn, offsets, packed, packed_run, rel
from tests.support.release import FACTS, MEGATRON

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS under use_deterministic_algorithms
RUNS = 5
PATCH = "gdn_thd" if FACTS.gdn_thd == "refuses" else "gdn_thd_deterministic"


@pytest.fixture(scope="module")
def layers(megatron_cpu):
    assert megatron_cpu == "cuda"
    if FACTS.gdn == "absent":
        pytest.skip(f"megatron-core {MEGATRON} has no GatedDeltaNet")
    import torch._dynamo.config as dynamo_config

    # megatron's jit_fuser'd helpers (torch.compile) recompile per norm type, shape and global state
    # (use_deterministic_algorithms is one); the earlier tests of this process use up torch's default
    # limit of 8, after which a helper runs eager: other bits, for a reason a training process never meets
    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    with pytest.MonkeyPatch.context() as mp, gdn_compat.applied() as report:
        mp.setattr(dynamo_config, limit, 64)
        assert report[PATCH].status == "applied", report[PATCH]
        det = build_gdn(device="cuda", dtype=torch.bfloat16, deterministic=True, seed=11, **QWEN3_NEXT)
        fast = build_gdn(device="cuda", dtype=torch.bfloat16, deterministic=False, seed=11, **QWEN3_NEXT)
        fast.load_state_dict(det.state_dict())
        gen = torch.Generator(device="cuda").manual_seed(5)
        x = torch.randn(sum(DESIGN_LENGTHS), 1, QWEN3_NEXT["hidden"], device="cuda", dtype=torch.bfloat16,
                        generator=gen)
        dy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        psp = packed(offsets(DESIGN_LENGTHS))
        psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
        yield det, fast, x, dy, psp


def _flat(result):
    out, dx, grads = result
    return {"output": out, "input grad": dx, **{f"grad {n}": g for n, g in grads.items()}}


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(tensors[k].detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def test_deterministic_thd_repeats_bit_for_bit(layers):
    det, _, x, dy, psp = layers
    torch.use_deterministic_algorithms(True)  # what megatron's --deterministic-mode training sets
    try:
        runs = [_flat(packed_run(det, x, psp, dy)) for _ in range(RUNS)]
    finally:
        torch.use_deterministic_algorithms(False)
    differ = sorted({k for r in runs[1:] for k in r if not torch.equal(r[k], runs[0][k])})
    print(f"\n[det-gpu {MEGATRON} {PATCH}, fla atomic-free: {FACTS.fla_atomic_free}] {RUNS} runs of "
          f"{sum(DESIGN_LENGTHS)} tokens: {'bitwise identical' if not differ else f'differ in {differ}'}; "
          f"digest {_digest(runs[0])}")
    assert not differ


def test_deterministic_thd_equals_the_non_deterministic_path(layers):
    det, fast, x, dy, psp = layers
    a, b = _flat(packed_run(det, x, psp, dy)), _flat(packed_run(fast, x, psp, dy))
    errs = {k: rel(a[k], b[k]) for k in a}
    same = all(torch.equal(a[k], b[k]) for k in a)
    gap = "bitwise equal" if same else f"output rel {errs['output']:.2g}, worst {max(errs.values()):.2g}"
    print(f"\n[det-gpu {MEGATRON}] deterministic vs non-deterministic THD: {gap}")
    if FACTS.fla_atomic_free is Accepts.YES:
        assert same  # the same kernels in the same order
    else:  # the per-sequence torch core: the bf16 bounds of the THD-vs-per-sequence GPU test
        assert errs["output"] <= 8e-3 and errs["input grad"] <= 3e-4
        assert max(v for k, v in errs.items() if k.startswith("grad")) <= 1e-2
