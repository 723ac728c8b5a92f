"""Context parallelism for the patched GatedDeltaNet (0.16.x/0.17.x): 2 and 4 ranks against cp = 1.

The parent process computes the cp = 1 run; each spawned rank runs its load-balanced shard and
checks its output shard, its input-grad shard and (summed over ranks, as Megatron's DP x CP
gradient reduction does) every parameter gradient. Ranks use gloo on the CPU, or NCCL when the
machine has a GPU per rank (the same file runs on a multi-GPU machine).
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

import gdn_compat
from tests.support.gdn import build_gdn, l2norm_ref, packed, packed_run, shard
from tests.support.release import skip_reason

pytestmark = pytest.mark.skipif(skip_reason("gdn_thd") is not None, reason=str(skip_reason("gdn_thd")))
SHAPE = dict(hidden=32, dk=8, dv=8, hk=4, hv=8)  # GQA, heads divisible by cp = 4
BSHD = (16, 2)  # sequence length, batch
THD_ACTUAL, THD_PADDED = [0, 5, 20, 27], [0, 8, 24, 32]  # padded lengths 8, 16, 8: divisible by 2 x 4


def cases():
    torch.manual_seed(3)
    s, b = BSHD
    xb = torch.randn(s, b, SHAPE["hidden"])
    xt = torch.randn(THD_PADDED[-1], 1, SHAPE["hidden"])
    weight = lambda t: torch.linspace(-1, 1, t.numel()).reshape(t.shape)  # noqa: E731
    return {"bshd": (xb, None, [s], weight), "thd": (xt, (THD_ACTUAL, THD_PADDED), [8, 16, 8], weight)}


def reference(path: str, device: str) -> None:
    m = build_gdn(device=device, deterministic=True, **SHAPE)
    results = {"state": m.state_dict()}
    for name, (x, cu, _, weight) in cases().items():
        psp = None if cu is None else packed(cu[0], padded=cu[1])
        out, gx, grads = packed_run(m, x.to(device), psp, weight(x).to(device))
        results[name] = {"out": out.cpu(), "gx": gx.cpu(), "grads": {n: g.cpu() for n, g in grads.items()}}
    torch.save(results, path)


def world_size() -> int:
    """4 gloo ranks on the CPU; on a GPU machine one rank per GPU, up to 4 (NCCL)."""
    return min(4, torch.cuda.device_count()) if torch.cuda.device_count() >= 2 else 4


def check_cp(m, ref, rank: int, cp: int, group, device: str) -> None:
    import torch.distributed as dist

    tol = dict(rtol=1e-4, atol=1e-5)
    m.pg_collection.cp = group
    for name, (x, cu, lengths, weight) in cases().items():
        psp = None if cu is None else packed(cu[0], padded=cu[1])
        w = shard(weight(ref[name]["out"]), lengths, cp, rank).to(device)
        out, gx, grads = packed_run(m, shard(x, lengths, cp, rank).to(device), psp, w)
        where = f"{name}, cp={cp}, rank {rank}"
        torch.testing.assert_close(out.cpu(), shard(ref[name]["out"], lengths, cp, rank), **tol,
                                   msg=lambda msg, w=where: f"output {w}: {msg}")
        torch.testing.assert_close(gx.cpu(), shard(ref[name]["gx"], lengths, cp, rank), **tol,
                                   msg=lambda msg, w=where: f"input grad {w}: {msg}")
        for pname, grad in grads.items():
            dist.all_reduce(grad, group=group)  # Megatron reduces gradients over data x context ranks
            torch.testing.assert_close(grad.cpu(), ref[name]["grads"][pname], **tol,
                                       msg=lambda msg, w=where, q=pname: f"grad {q} {w}: {msg}")


def worker(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.support.megatron import world as megatron_world

    cuda = torch.cuda.device_count() >= world
    with megatron_world(rank, world, cp=world, port=port, cuda=cuda) as device, gdn_compat.applied():
        ref = torch.load(path)
        m = build_gdn(device=device, deterministic=True, **SHAPE)
        m.load_state_dict(ref["state"])
        pairs = [dist.new_group([i, i + 1]) for i in range(0, world, 2)]  # every rank creates every group
        m.pg_collection.cp = pairs[rank // 2]
        with torch.inference_mode():  # an evaluation pass first, on the same offsets: its packs (CP permutations
            for x, cu, lengths, _ in cases().values():  # included) must never reach the training steps below (#41)
                psp = None if cu is None else packed(cu[0], padded=cu[1])
                m(shard(x, lengths, 2, rank % 2).to(device), None, packed_seq_params=psp)
        check_cp(m, ref, rank % 2, 2, pairs[rank // 2], device)
        if world == 4:
            check_cp(m, ref, rank, 4, parallel_state.get_context_parallel_group(), device)
        dist.barrier()


@pytest.mark.heavy
def test_context_parallel_2_and_4_ranks_equal_cp1_bshd_and_thd(megatron_cpu, monkeypatch):
    import megatron.core.ssm.gated_delta_net as release

    from tests.support.megatron import free_port, spawn

    monkeypatch.setattr(release, "l2norm", l2norm_ref)  # the cp = 1 BSHD reference is the release's code
    world = world_size()
    with tempfile.TemporaryDirectory() as tmp, gdn_compat.applied():
        path = os.path.join(tmp, "ref.pt")
        reference(path, megatron_cpu)
        started = time.perf_counter()
        spawn(worker, (world, free_port(), path), world)
        print(f"\n[cp] {world} ranks (cp=2 pairs{' and cp=4' if world == 4 else ''}): "
              f"{time.perf_counter() - started:.1f} s")


class FakeGroup:
    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture
def patched_cpu(megatron_cpu, monkeypatch):
    import megatron.core.ssm.gated_delta_net as release

    monkeypatch.setattr(release, "l2norm", l2norm_ref)
    with gdn_compat.applied():
        yield


def test_thd_lengths_must_divide_by_twice_cp(patched_cpu):
    m = build_gdn(**SHAPE)
    m.pg_collection.cp = FakeGroup(2)
    with pytest.raises(ValueError, match=r"divisible by 2 x cp = 4.*offending lengths \[6, 6\]"):
        m(torch.randn(6, 1, 32), None, packed_seq_params=packed([0, 6, 12]))


def test_bshd_length_must_divide_by_twice_cp(patched_cpu):
    m = build_gdn(**SHAPE)
    m.pg_collection.cp = FakeGroup(2)
    with pytest.raises(ValueError, match=r"divisible by 2 x cp = 4; got 6"):
        m(torch.randn(3, 2, 32), None)


def test_heads_must_divide_by_tp_times_cp(patched_cpu):
    m = build_gdn(hidden=32, dk=8, dv=8, hk=2, hv=4)
    m.pg_collection.cp = FakeGroup(4)
    with pytest.raises(ValueError, match=r"tp x cp = 1 x 4; got 2 key heads and 4 value heads"):
        m(torch.randn(2, 1, 32), None)
