"""gdn_out_norm_tp_grad (#14) at tp = 2 on the CPU (gloo), trained as Megatron trains: the release's
own DistributedDataParallel and finalize_model_grads, against the same weights at tp = 1.

Unpatched, sequence parallelism off: each rank's out_norm gradient is its partial sum (the two
ranks' add up to the tp = 1 gradient) and one optimizer step makes the two copies differ (upstream
#7452). Patched: equal to tp = 1 and the copies stay bitwise identical over several steps. Sequence
parallelism on with a norm whose weight is marked ``sequence_parallel`` (as Transformer Engine's):
the release already sums it, and the patch must not sum it again.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import gdn_compat
from tests.support import model as M
from tests.support.gdn import use_torch_l2norm
from tests.support.release import FACTS, skip_reason

pytestmark = [pytest.mark.skipif(skip_reason("gdn_out_norm_tp_grad") is not None,
                                 reason=str(skip_reason("gdn_out_norm_tp_grad"))),
              pytest.mark.heavy]
SEQ, STEPS, LR = 16, 3, 0.5
OUT_NORM = "self_attention.out_norm.weight"


def _batch():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, M.VOCAB, (1, SEQ), generator=gen)
    return dict(input_ids=ids, position_ids=torch.arange(SEQ)[None], attention_mask=None,
                labels=torch.randint(1, M.VOCAB, (1, SEQ), generator=gen))


def _reference(path: str) -> None:
    model = M.build(M.config(layers=2, deterministic=True))
    model(**_batch()).sum().backward()
    torch.save({"state": {n: p.detach().clone() for n, p in model.named_parameters()},
                "grads": {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith(OUT_NORM)}}, path)


def _train(ref: dict, sp: bool, tp_rank: int) -> dict:
    """First step's out_norm grads, then the out_norm weights after STEPS plain SGD steps."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    cfg = M.config(tp=2, sp=sp, layers=2, deterministic=True)
    model = M.build(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(M.split(name, ref["state"][name], 2, tp_rank))
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    out = {}
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        ddp(**_batch()).sum().backward()
        finalize_model_grads([ddp])
        params = dict(model.named_parameters())
        if step == 0:
            out["grads"] = {n: p.main_grad.clone() for n, p in params.items() if n.endswith(OUT_NORM)}
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(LR * p.main_grad)
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(OUT_NORM)}
    return out


def _worker(rank: int, port: int, ref_path: str, out_path: str) -> None:
    from megatron.core import parallel_state

    from tests.support.megatron import world

    results = {}
    with world(rank, 2, tp=2, port=port), pytest.MonkeyPatch.context() as mp:
        use_torch_l2norm(mp)
        ref = torch.load(ref_path)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        for patched in (False, True):
            for sp in (False, True):
                with gdn_compat.applied(gdn_out_norm_tp_grad=patched) as report:
                    assert (report["gdn_out_norm_tp_grad"].status == "applied") == patched
                    results[(patched, sp)] = _train(ref, sp, tp_rank)
        with gdn_compat.applied():  # the release's own torch norm refuses sequence parallelism outright
            from megatron.core.transformer.torch_norm import WrappedTorchNorm

            try:
                WrappedTorchNorm(M.config(tp=2, sp=True, layers=2), hidden_size=8)
                results["torch_norm_sp"] = "accepted"
            except AssertionError as exc:
                results["torch_norm_sp"] = str(exc)
    torch.save(results, out_path.format(rank=rank))


@pytest.fixture(scope="module")
def runs(megatron_cpu):
    from tests.support.megatron import free_port, spawn

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patcher:
        use_torch_l2norm(patcher)
        ref_path, out_path = os.path.join(tmp, "ref.pt"), os.path.join(tmp, "out-{rank}.pt")
        _reference(ref_path)
        spawn(_worker, (free_port(), ref_path, out_path), 2)
        return torch.load(ref_path), [torch.load(out_path.format(rank=r)) for r in range(2)]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_unpatched_release_leaves_each_rank_its_partial_gradient_and_the_copies_drift(runs):
    ref, ranks = runs
    for name, full in ref["grads"].items():
        g0, g1 = (r[(False, False)]["grads"][name] for r in ranks)
        w0, w1 = (r[(False, False)]["weights"][name] for r in ranks)
        print(f"\n[out_norm tp2 unpatched {FACTS.release}] {name}: rank grads rel {_rel(g0, full):.2f} / "
              f"{_rel(g1, full):.2f} to tp1; copies after {STEPS} steps differ by {(w0 - w1).abs().max():.2e}")
        assert _rel(g0, full) > 0.1 and _rel(g1, full) > 0.1, name  # neither rank has the true gradient
        torch.testing.assert_close(g0 + g1, full, rtol=1e-5, atol=1e-7)  # they are its two partial sums
        assert not torch.equal(w0, w1), f"{name}: the replicated copies should have drifted apart"


@pytest.mark.parametrize("sp", [False, True], ids=["sp-off", "sp-on"])
def test_patched_gradient_equals_tp1_and_the_copies_stay_identical(runs, sp):
    ref, ranks = runs
    for name, full in ref["grads"].items():
        print(f"\n[out_norm tp2 patched sp={sp} {FACTS.release}] {name}: rel "
              + " / ".join(f"{_rel(r[(True, sp)]['grads'][name], full):.1e}" for r in ranks))
        for r in ranks:
            assert _rel(r[(True, sp)]["grads"][name], full) < 1e-6, (name, _rel(r[(True, sp)]["grads"][name], full))
        w0, w1 = (r[(True, sp)]["weights"][name] for r in ranks)
        assert torch.equal(w0, w1), f"{name}: copies differ after {STEPS} steps"


def test_with_a_sequence_parallel_norm_the_release_is_right_and_the_patch_does_not_sum_twice(runs):
    ref, ranks = runs
    for name in ref["grads"]:
        for r in ranks:
            unpatched, patched = r[(False, True)]["grads"][name], r[(True, True)]["grads"][name]
            assert torch.equal(unpatched, patched), name  # a second sum would double it
            assert _rel(unpatched, ref["grads"][name]) < 1e-6


def test_the_release_torch_norm_refuses_sequence_parallelism(runs):
    _, ranks = runs
    assert "sequence parallel not supported" in ranks[0]["torch_norm_sp"], FACTS.release


def test_gdn_modules_are_recognised_by_their_per_head_norm_not_by_class_name():
    """main adds GatedDeltaNet2 (gdn2.py, a sibling class) with the same per-head out_norm: the hole is the
    structure, so the patch selects modules by it."""
    from gdn_compat.patches.gdn_out_norm_tp_grad import per_head_out_norm

    class GDN2Like(torch.nn.Module):  # not a GatedDeltaNet subclass
        def __init__(self, dv=16, heads=4, norm_width=None):
            super().__init__()
            self.value_head_dim, self.num_value_heads = dv, heads
            self.out_norm = torch.nn.RMSNorm(norm_width or dv)

    assert per_head_out_norm(GDN2Like())
    assert not per_head_out_norm(GDN2Like(norm_width=64))  # a norm over all heads: each rank sees its whole input
    assert not per_head_out_norm(torch.nn.Linear(4, 4))
