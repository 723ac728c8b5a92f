"""Hostile inputs to the packed path (#17): offsets changed behind autograd's back, inference mode,
an empty pack, padded offsets given partly, actual lengths that do not fit their padded slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gdn_compat
from gdn_compat.patches import gdn_thd
from tests.support.gdn import build_gdn, l2norm_ref, packed
from tests.support.release import skip_reason

pytestmark = pytest.mark.skipif(skip_reason("gdn_thd") is not None, reason=str(skip_reason("gdn_thd")))


@pytest.fixture(autouse=True)
def patched(megatron_cpu, monkeypatch):
    import megatron.core.ssm.gated_delta_net as release

    monkeypatch.setattr(release, "l2norm", l2norm_ref)
    gdn_thd.PACKS.clear()
    with gdn_compat.applied(mtp_padding_mask=False):
        yield


def _fresh(m, x, cu):
    gdn_thd.PACKS.clear()
    return m(x, None, packed_seq_params=packed(cu))[0]


def _mutate_data(cu):
    cu.data[1] = 6


def _mutate_numpy(cu):
    cu.numpy()[1] = 6


@pytest.mark.parametrize("route", [_mutate_data, _mutate_numpy], ids=["data", "numpy"])
def test_offsets_written_behind_autograd_are_never_served_stale(route):
    m = build_gdn()
    x = torch.randn(12, 1, 64)
    psp = packed([0, 4, 12])
    before = m(x, None, packed_seq_params=psp)[0]
    route(psp.cu_seqlens_q)  # the same tensor object (shared by q and kv), new values, _version unchanged
    after = m(x, None, packed_seq_params=psp)[0]
    assert not torch.equal(after, before)
    assert torch.equal(after, _fresh(m, x, [0, 6, 12]))


def test_offsets_from_a_numpy_array_written_through_the_array_are_not_served_stale():
    m = build_gdn()
    x = torch.randn(12, 1, 64)
    arr = np.array([0, 4, 12], dtype=np.int32)
    psp = packed([0, 4, 12])
    psp.cu_seqlens_q = psp.cu_seqlens_kv = torch.from_numpy(arr)
    m(x, None, packed_seq_params=psp)
    arr[1] = 6
    assert torch.equal(m(x, None, packed_seq_params=psp)[0], _fresh(m, x, [0, 6, 12]))


def test_packed_input_runs_under_inference_mode():
    m = build_gdn()
    x = torch.randn(12, 1, 64)
    with torch.no_grad():
        expected = m(x, None, packed_seq_params=packed([0, 5, 12]))[0]
    gdn_thd.PACKS.clear()
    with torch.inference_mode():
        psp = packed([0, 5, 12])  # inference tensors: no version counter
        assert psp.cu_seqlens_q.is_inference()
        first = m(x, None, packed_seq_params=psp)[0]
        psp.cu_seqlens_q[1] = 7  # an in-place write inference mode allows
        second = m(x, None, packed_seq_params=psp)[0]
    assert torch.equal(first, expected)
    assert torch.equal(second, _fresh(m, x, [0, 7, 12]))


def test_an_empty_pack_gives_an_empty_output_and_zero_gradients():
    m = build_gdn()
    x = torch.randn(0, 1, 64, requires_grad=True)
    out, bias = m(x, None, packed_seq_params=packed([0, 0]))
    assert out.shape == (0, 1, 64) and bias is None
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 1, 64)
    for name, p in m.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


def test_only_q_padded_offsets_given_compare_like_with_like():
    m = build_gdn()
    x = torch.randn(16, 1, 64)
    full = packed([0, 5, 12], padded=[0, 8, 16])
    partial = packed([0, 5, 12], padded=[0, 8, 16])
    partial.cu_seqlens_kv_padded = None  # q's padded offsets only: kv's actual ones must not be compared to them
    assert torch.equal(m(x, None, packed_seq_params=partial)[0], _fresh_psp(m, x, full))


def _fresh_psp(m, x, psp):
    gdn_thd.PACKS.clear()
    return m(x, None, packed_seq_params=psp)[0]


@pytest.mark.parametrize("actual,padded,match", [
    ([0, 9, 12], [0, 8, 16], r"lengths \[9, 3\], slots \[8, 8\]"),
    ([0, 4, 8, 12], [0, 8, 16], r"lengths \[4, 4, 4\], slots \[8, 8\]"),
])
def test_actual_lengths_must_fit_their_padded_slots(actual, padded, match):
    with pytest.raises(ValueError, match=r"does not fit cu_seqlens_q_padded.*" + match):
        build_gdn()(torch.randn(16, 1, 64), None, packed_seq_params=packed(actual, padded=padded))
