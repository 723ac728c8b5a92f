"""gdn_thd_deterministic (#15, CPU part) on 0.18.x/0.19.x's real GatedDeltaNet.

Unpatched, the release asserts on packed input in deterministic mode. Patched, a pack (padded
slots, a length-1 sequence) gives per token what the release's own deterministic code gives for each
sequence run alone, and the pure float64 recurrence; every other call is the release's forward.
(0.16/0.17: gdn_thd's packed path covers deterministic mode; tests/test_gdn_thd.py.)
"""

from __future__ import annotations

import pytest
import torch

import gdn_compat
from tests.support.gdn import build_gdn, offsets, packed, packed_run, reference_gdn, rel, use_torch_l2norm
from tests.support.release import FACTS, skip_reason

pytestmark = pytest.mark.skipif(skip_reason("gdn_thd_deterministic") is not None,
                                reason=str(skip_reason("gdn_thd_deterministic")))

LENGTHS, SLOTS = [5, 1, 11, 4], [8, 4, 12, 4]
CFG = dict(dk=16, dv=16, hk=2, hv=4, kernel=4, eps=1e-5)


@pytest.fixture
def layer(megatron_cpu, monkeypatch):
    use_torch_l2norm(monkeypatch)
    return build_gdn(megatron_cpu, deterministic=True)


def _pack():
    return packed(offsets(LENGTHS), offsets(SLOTS))


def _x(device):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(sum(SLOTS), 1, 64, generator=gen).to(device)


def test_release_refuses_packed_input_in_deterministic_mode(layer, megatron_cpu):
    with pytest.raises(AssertionError, match="Packed sequence does not support deterministic mode"):
        layer(_x(megatron_cpu), None, packed_seq_params=_pack())


def test_patched_pack_equals_the_release_on_each_sequence_alone(layer, megatron_cpu):
    x = _x(megatron_cpu)
    real = torch.cat([torch.arange(s, s + n) for s, n in zip(offsets(SLOTS), LENGTHS)])
    dy = torch.zeros_like(x)  # padding slots carry no loss (their outputs would feed real tokens' grads)
    dy[real] = torch.linspace(-1, 1, dy[real].numel()).reshape(dy[real].shape).to(x)
    singles = []  # the release's own deterministic (unpacked) forward, one sequence at a time
    for start, n in zip(offsets(SLOTS), LENGTHS):
        singles.append(packed_run(layer, x[start:start + n], None, dy[start:start + n]))
    with gdn_compat.applied() as report:
        assert report["gdn_thd_deterministic"].status == "applied"
        out, dx, grads = packed_run(layer, x, _pack(), dy)
    assert rel(out[real], torch.cat([s[0] for s in singles])) < 1e-5
    assert rel(dx[real], torch.cat([s[1] for s in singles])) < 1e-5
    for name, grad in grads.items():
        want = sum(s[2][name] for s in singles)
        if name in ("A_log", "dt_bias"):
            # the gate grads are sums of per-sequence terms that cancel (here one entry of A_log's
            # falls to ~7e-5 from terms ~1e-3), so fp32 rounding is judged against the terms' size, not
            # the cancelled total: measured 2.0e-4 relative to the total on one CPU, 1e-6 to the terms
            scale = sum(s[2][name].float().norm() for s in singles)
            err = (grad.float() - want.float()).norm() / scale
            print(f"[{name}] error {err:.1e} of the per-sequence terms (rel to the total {rel(grad, want):.1e})")
            assert err < 1e-5, name
        else:
            assert rel(grad, want) < 1e-5, name
    params = {n: p.detach() for n, p in layer.named_parameters()}
    spans = [(s, s + n) for s, n in zip(offsets(SLOTS), LENGTHS)]
    want = reference_gdn(params, CFG, x[:, 0], spans)  # float64, token by token
    assert rel(out[real, 0], want[real]) < 1e-5


def test_repeated_runs_are_bitwise_identical(layer, megatron_cpu):
    x = _x(megatron_cpu)
    with gdn_compat.applied():
        runs = [packed_run(layer, x, _pack()) for _ in range(3)]
    for out, dx, grads in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(dx, runs[0][1])
        assert all(torch.equal(grads[n], runs[0][2][n]) for n in grads)


def test_unpacked_deterministic_input_is_the_release_forward(layer, megatron_cpu):
    x = _x(megatron_cpu)[:16].reshape(8, 2, 64)
    want = packed_run(layer, x, None)
    with gdn_compat.applied():
        got = packed_run(layer, x, None)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])


def test_the_fla_core_normalises_q_and_k_with_the_l2norm_the_release_itself_uses(megatron_cpu):
    """On CUDA deterministic THD runs fla's kernels with the release's l2norm (0.19 keeps it in the
    package's common.py, not next to forward): the function its own THD preparation reads."""
    import inspect
    import sys

    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from gdn_compat._probe import probe
    from gdn_compat.patches.gdn_thd.kernels import Core

    # its jit_fuser (torch.compile) wrapper keeps the function under __wrapped__
    prepare = [inspect.unwrap(getattr(GatedDeltaNet, n)) for n in dir(GatedDeltaNet) if n.startswith("_prepare")]
    used = {id(f.__globals__["l2norm"]) for f in prepare if "l2norm" in f.__code__.co_names}
    assert len(used) == 1, [f.__qualname__ for f in prepare]
    core = Core(sys.modules[GatedDeltaNet.forward.__module__], probe().fla_varlen)
    assert id(core.l2norm_home.l2norm) in used


def _saved_bytes(layer, x, psp) -> tuple[int, torch.Tensor]:
    """Bytes of the tensors autograd keeps for one packed forward (after the forward, so storages a checkpoint
    discarded count as what they hold then), and the forward's output."""
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = layer(x, None, packed_seq_params=psp)[0]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return sum(storages.values()), out


def test_selective_recompute_of_the_gated_norm_is_honoured_on_the_packed_path(megatron_cpu, monkeypatch):
    # 0.19's recompute_modules=["gdn_norm_out"]: the release keeps no norm output and recomputes it in backward;
    # gdn_compat's packed path does the same (#37 item 4): less kept, the same gradients bit for bit
    use_torch_l2norm(monkeypatch)
    layer = build_gdn(megatron_cpu, deterministic=True)
    if not hasattr(layer, "recompute_norm_out"):
        pytest.skip(f"{FACTS.release} has no selective recompute of the GDN output norm")
    x = _x(megatron_cpu).requires_grad_(True)
    runs = {}
    with gdn_compat.applied():
        for recompute in (False, True):
            layer.recompute_norm_out = recompute
            kept, out = _saved_bytes(layer, x, _pack())
            layer.zero_grad(set_to_none=True)
            x.grad = None
            out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
            runs[recompute] = (kept, out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()})
    plain, recomputed = runs[False], runs[True]
    assert recomputed[0] < plain[0]  # the norm's output is not kept
    assert torch.equal(recomputed[1], plain[1]) and torch.equal(recomputed[2], plain[2])
    assert all(torch.equal(recomputed[3][n], plain[3][n]) for n in plain[3])
