"""gdn_flashqla's decisions and its adapter on the CPU (FlashQLA itself runs only on sm90/sm100/sm103 GPUs:
tests/gpu/test_fast_gpu.py). The adapter is checked through the fused region with a FlashQLA stand-in of the same
contract (grouped value heads, per-key-head dq/dk): what gdn_compat hands FlashQLA, against the reference."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import gdn_compat
from gdn_compat._probe import Dist
from gdn_compat.patches import gdn_flashqla
from tests.support.fused import CU, DIMS, FakeFlashQla, gradients, interpreted_or_cuda, region_inputs, token_bounds
from tests.support.gdn import build_gdn, offsets, packed, packed_run, use_torch_l2norm
from tests.support.release import FACTS, MEGATRON


def test_flashqla_is_skipped_with_a_reason_when_absent_or_too_old():
    assert "flash-qla is not installed" in str(gdn_flashqla.flashqla_skip(dataclasses.replace(FACTS, flashqla=None)))
    old = gdn_flashqla.flashqla_skip(dataclasses.replace(FACTS, flashqla=Dist("flash-qla", "0.1.2")))
    assert "0.1.2 is older than 0.1.3" in str(old) and "strong decay" in str(old)
    assert gdn_flashqla.flashqla_skip(dataclasses.replace(FACTS, flashqla=Dist("flash-qla", "0.1.3"))) is None


@pytest.fixture
def installed(monkeypatch):
    """The probe reports flash-qla 0.1.3 (its metadata only: nothing imports it on the CPU)."""
    from gdn_compat import _probe

    def fake(out):
        out["flashqla"], out["flashqla_atomic_free"] = Dist("flash-qla", "0.1.3"), "yes"

    monkeypatch.setattr(_probe, "_probe_flashqla", fake)


def test_on_the_cpu_a_packed_call_keeps_fla_and_says_why(installed, megatron_cpu, monkeypatch, caplog):
    facts = gdn_compat.probe()
    [rec] = [r for r in gdn_compat.plan(facts, gdn_flashqla=True) if r.name == "gdn_flashqla"]
    if rec.status != "would_apply":
        pytest.skip(f"gdn_flashqla on {MEGATRON}: {rec.reason}")
    use_torch_l2norm(monkeypatch)
    layer = build_gdn(megatron_cpu, deterministic=True)
    x = torch.randn(sum([3, 9, 1]), 1, 64, generator=torch.Generator().manual_seed(2))
    psp = packed(offsets([3, 9, 1]))
    with gdn_compat.applied():
        want = packed_run(layer, x, psp)
    with caplog.at_level(logging.INFO, logger="gdn_compat"), gdn_compat.applied(gdn_flashqla=True) as report:
        assert report["gdn_flashqla"].status == "applied"
        got = packed_run(layer, x, psp)
    assert "gdn_flashqla not used for a packed GDN call: FlashQLA needs a CUDA tensor" in caplog.text
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(interpreted_or_cuda() is not None, reason=str(interpreted_or_cuda()))
def test_the_region_hands_flashqla_unrepeated_qk_and_long_offsets_and_matches_the_reference():
    from gdn_compat.fused import reference
    from gdn_compat.fused.cores import FlashQlaCore
    from gdn_compat.fused.region import Spec, region

    fake = FakeFlashQla()
    cu = torch.tensor(CU, dtype=torch.int64)
    spec = Spec(**DIMS, l2norm=True, norm_eps=1e-5, zero_centered=False, core=FlashQlaCore(fake, cu))
    x, params = region_inputs()
    y, grads = gradients(lambda *a: region(*a, token_bounds(CU, x.shape[0]), spec), x, params)
    y_ref, grads_ref = gradients(
        lambda xx, cw, cb, al, dt, nw: reference.region(xx, cw, cb, al, dt, nw, CU, **DIMS),
        x.double(), {k: v.double() for k, v in params.items()})
    assert fake.calls and all(c["q_heads"] == DIMS["hk"] and c["v_heads"] == DIMS["hv"] for c in fake.calls)
    assert all(c["cu_dtype"] == torch.int64 and c["auto_cp"] is False for c in fake.calls)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad.double(), grads_ref[name], rtol=1e-4, atol=1e-5, msg=name)
