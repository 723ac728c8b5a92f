"""gdn_cp_state (#56) on CUDA with fla's kernels, bf16: a GDN layer at cp = 2 passing the delta rule's state between
ranks, against the same layer at cp = 1 and a float64 per-sequence truth.

The two ranks share one GPU when only one is lent (gloo carries CUDA tensors; with two GPUs each rank has its own).
3 key / 9 value heads: neither divides cp = 2, so only state passing can run this layer at cp = 2. The pack has a
zero-length entry and padding. Every rank builds the layer twice from the same weights: with a one-rank context group
(cp = 1, the whole pack, the packed path the other GPU tests hold to per-sequence runs) and with the two-rank group
(cp = 2, its load-balanced shard). Output, input gradient and every parameter gradient (summed over the ranks, as
megatron's DP x CP reduction does) must be as close to the float64 truth as cp = 1 is (within 2x: bf16 rounds the
two differently). With fla-core 0.4.2 the rule runs as fla's chunk steps with the transitions apart
(gdn_thd/state_steps.py); with another fla once K + V wide (state_cp.py): the test checks which one ran. The CPU file
tests/test_cp_state.py holds the same contract with the release's torch rule.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from gdn_compat._probe import Accepts
from tests.support.gdn import err_of, offsets, reference_gdn, unshard
from tests.support.release import FACTS, MEGATRON, skip_reason

SHAPE = dict(hidden=2048, dk=128, dv=128, hk=3, hv=9)
CFG = dict(dk=128, dv=128, hk=3, hv=9, kernel=4, eps=1e-5)
ACTUAL = [5, 70, 0, 300, 129, 431]
PADDED = [n + (-n % 4) for n in ACTUAL]  # multiples of 2 x cp


def _applies() -> str | None:
    if MEGATRON is None:
        return "megatron-core is not installed"
    if FACTS.gdn == "absent":
        return f"{FACTS.release} has no GatedDeltaNet"
    return skip_reason("gdn_cp_state", gdn_cp_state=True)


SKIP = _applies()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))


def _case():
    gen = torch.Generator().manual_seed(56)
    total = sum(PADDED)
    x = torch.randn(total, 1, SHAPE["hidden"], generator=gen).to(torch.bfloat16)
    real = torch.zeros(total, dtype=torch.bool)
    spans = []
    for p, n in zip(offsets(PADDED), ACTUAL):
        real[p:p + n] = True
        spans.append((p, p + n))
    dy = (torch.randn(total, 1, SHAPE["hidden"], generator=gen) * real[:, None, None]).to(torch.bfloat16)
    return x, dy, real, spans


def _worker(rank: int, port: int, folder: str) -> None:
    import gdn_compat
    from gdn_compat.patches.gdn_thd import state_steps
    from tests.support.megatron import world

    calls = []
    original = state_steps.delta_rule

    def counted(steps, *args):  # which steps ran: fla-core 0.4.2's (FlaSteps) or none (the one-pass path)
        calls.append(type(steps).__name__)
        return original(steps, *args)

    state_steps.delta_rule = counted
    with world(rank, 2, cp=2, port=port, cuda=True, backend="gloo"), \
            gdn_compat.applied(gdn_cp_state=True) as report:
        assert "gdn_cp_state" in report.applied, report
        _check(rank, folder, calls)


def _fla_steps() -> bool:
    return FACTS.fla_varlen.state_steps is Accepts.YES


def _check(rank: int, folder: str, calls: list) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.support.gdn import build_gdn, packed, packed_run, shard

    solo = [dist.new_group([r]) for r in range(2)]  # every rank creates every group
    kw = dict(device="cuda", dtype=torch.bfloat16, **SHAPE)
    m1 = build_gdn(cp_group=solo[rank], **kw)
    m2 = build_gdn(cp_group=parallel_state.get_context_parallel_group(), **kw)
    m2.load_state_dict(m1.state_dict())
    psp = packed(offsets(ACTUAL), padded=offsets(PADDED))
    for t in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        setattr(psp, t, getattr(psp, t).cuda())
    x, dy, _, _ = _case()
    out1, gx1, g1 = packed_run(m1, x.cuda(), psp, dy.cuda())
    out2, gx2, g2 = packed_run(m2, shard(x, PADDED, 2, rank).cuda(), psp, shard(dy, PADDED, 2, rank).cuda())
    g2 = {n: g.float() for n, g in g2.items()}
    for g in g2.values():
        dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
    result = {"out2": out2.cpu(), "gx2": gx2.cpu(), "calls": calls}
    if rank == 0:
        result |= {"out1": out1.cpu(), "gx1": gx1.cpu(), "g1": {n: g.cpu() for n, g in g1.items()},
                   "g2": {n: g.cpu() for n, g in g2.items()},
                   "params": {n: p.detach().cpu() for n, p in m1.named_parameters()}}
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))  # files: a queue's shared memory dies with its rank
    dist.barrier()


def test_state_passing_at_cp2_is_as_close_to_the_float64_truth_as_cp1_with_fla():
    import torch.multiprocessing as mp

    from tests.support.megatron import free_port

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_worker, args=(free_port(), folder), nprocs=2, join=True, start_method="spawn")
        got = {r: torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(2)}
    x, dy, real, spans = _case()
    r0 = got[0]
    params = {n: p.double().requires_grad_(True) for n, p in r0["params"].items()}
    x64 = x[:, 0].double().requires_grad_(True)
    truth = reference_gdn(params, CFG, x64, spans)
    (truth * dy[:, 0].double()).sum().backward()
    out2 = unshard([got[r]["out2"][:, 0] for r in range(2)], PADDED, 2)
    gx2 = unshard([got[r]["gx2"][:, 0] for r in range(2)], PADDED, 2)
    pairs = {"output": (out2[real], r0["out1"][:, 0][real], truth.detach()[real]),
             "input grad": (gx2, r0["gx1"][:, 0], x64.grad)}
    pairs |= {f"{n} grad": (r0["g2"][n], r0["g1"][n], params[n].grad) for n in params}
    failures = []
    steps = {r: got[r]["calls"] for r in range(2)}
    print(f"\n[cp-state-gpu {MEGATRON}] fla {FACTS.fla}: the steps each rank ran: {steps}", end="")
    if steps[0] != (["FlaSteps"] if _fla_steps() else []) or steps[1] != steps[0]:
        failures.append(f"fla's chunk steps {FACTS.fla_varlen.state_steps}, but the ranks ran {steps}")
    for what, (ours, one, want) in pairs.items():
        err, base = err_of(ours, want), err_of(one, want)
        print(f"\n[cp-state-gpu {MEGATRON}] {what}: cp2 {err:.3g}  cp1 {base:.3g} (from float64)", end="")
        if err > 2 * base:
            failures.append(f"{what}: cp 2 {err:.3g} from the float64 truth; cp 1: {base:.3g}")
    print()
    assert not failures, failures
