"""gdn_thd_cp_fused (#22 item 3): 0.18.x packed GDN under context parallelism through one all-to-all each way.

Each gloo rank (cp = 2 pairs and cp = 4) runs its load-balanced shard of a padded pack through the
release's own native packed CP path (fla's two varlen kernels replaced by torch, ``fla_on_cpu``) and
through the patched path, and checks both against the release's cp = 1 run of the whole pack in the
parent: output and input-grad shards, and every parameter gradient summed over the cp ranks.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import gdn_compat
from tests.support.gdn import build_gdn, fla_on_cpu, packed, packed_run, shard
from tests.support.release import skip_reason

pytestmark = [pytest.mark.skipif(skip_reason("gdn_thd_cp_fused") is not None,
                                 reason=str(skip_reason("gdn_thd_cp_fused"))),
              pytest.mark.heavy]
SHAPE = dict(hidden=32, dk=8, dv=8, hk=4, hv=8)  # heads divisible by cp = 4
ACTUAL, PADDED, SLOTS = [0, 5, 20, 21, 29], [0, 8, 24, 32, 40], [8, 16, 8, 8]  # a length-1 sequence too


def _inputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(PADDED[-1], 1, SHAPE["hidden"], generator=gen)
    return x, torch.randn(x.shape, generator=gen)


def _reference(path: str) -> None:
    m = build_gdn(**SHAPE)
    x, dy = _inputs()
    out, gx, grads = packed_run(m, x, packed(ACTUAL, padded=PADDED), dy)
    torch.save({"state": m.state_dict(), "out": out, "gx": gx, "grads": grads}, path)


def _check(ref, rank: int, cp: int, group, label: str) -> dict:
    import torch.distributed as dist

    m = build_gdn(cp_group=group, **SHAPE)  # the release reads its cp size once, at construction
    m.load_state_dict(ref["state"])
    x, dy = _inputs()
    calls, real = [], dist.all_to_all_single

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        out, gx, grads = packed_run(m, shard(x, SLOTS, cp, rank), packed(ACTUAL, padded=PADDED),
                                    shard(dy, SLOTS, cp, rank))
    finally:
        dist.all_to_all_single = real
    grads["all_to_alls"] = torch.tensor(len(calls))
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, shard(ref["out"], SLOTS, cp, rank), **tol, msg=lambda s: f"{label} output: {s}")
    torch.testing.assert_close(gx, shard(ref["gx"], SLOTS, cp, rank), **tol, msg=lambda s: f"{label} input grad: {s}")
    for name, grad in grads.items():
        if name == "all_to_alls":
            continue
        dist.all_reduce(grad, group=group)
        torch.testing.assert_close(grad, ref["grads"][name], **tol, msg=lambda s, n=name: f"{label} grad {n}: {s}")
    return {"out": out, "gx": gx, **grads}


def _worker(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.support.megatron import world as megatron_world

    with megatron_world(rank, world, cp=world, port=port):
        fla_on_cpu()
        ref = torch.load(path)
        pairs = [dist.new_group([i, i + 1]) for i in range(0, world, 2)]
        for cp, group, r in ((2, pairs[rank // 2], rank % 2), (4, parallel_state.get_context_parallel_group(), rank)):
            native = _check(ref, r, cp, group, f"release, cp={cp}, rank {r}")
            with gdn_compat.applied() as report:
                assert report["gdn_thd_cp_fused"].status == "applied"
                fused = _check(ref, r, cp, group, f"gdn_thd_cp_fused, cp={cp}, rank {r}")
            a2a = {"release": int(native.pop("all_to_alls")), "patched": int(fused.pop("all_to_alls"))}
            worst = max(float((fused[k] - native[k]).abs().max()) for k in native)
            if rank == 0:
                print(f"[cp-fused cp={cp}] patched vs release shard: max |diff| {worst:.1e}; all-to-alls per "
                      f"forward+backward of a {len(SLOTS)}-sequence pack: {a2a}")
            assert a2a["release"] >= 4 * len(SLOTS)  # the hole: two each way per sequence
            assert a2a["patched"] == 4  # one each way, forward and backward
        dist.barrier()


def test_patched_packed_cp_equals_the_release_per_sequence_path_and_cp1(megatron_cpu, monkeypatch):
    from tests.support.megatron import free_port, spawn

    fla_on_cpu(monkeypatch.setattr)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ref.pt")
        _reference(path)  # cp = 1: the release's own native THD, whole pack
        spawn(_worker, (4, free_port(), path), 4)


def test_cp1_and_unpacked_calls_stay_the_release_forward(megatron_cpu, monkeypatch):
    fla_on_cpu(monkeypatch.setattr)
    m = build_gdn(**SHAPE)
    x, dy = _inputs()
    before = packed_run(m, x, packed(ACTUAL, padded=PADDED), dy)
    with gdn_compat.applied() as report:
        assert report["gdn_thd_cp_fused"].status == "applied"
        after = packed_run(m, x, packed(ACTUAL, padded=PADDED), dy)
        with pytest.raises(Exception, match="fla|Triton|cuda|CUDA|driver"):  # not taken over at cp = 1:
            monkeypatch.undo()  # with fla's real kernels back, the release's own path runs (and needs a GPU)
            packed_run(m, x, packed(ACTUAL, padded=PADDED), dy)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
