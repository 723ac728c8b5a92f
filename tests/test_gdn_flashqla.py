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


@pytest.mark.usefixtures("fresh_fallback_notes")
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
    assert ("gdn_flashqla not used for a packed GDN call: FlashQLA needs a CUDA tensor; such calls run as with "
            "gdn_flashqla off") in caplog.text  # what runs instead, and the next line shows it is so
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(interpreted_or_cuda() is not None, reason=str(interpreted_or_cuda()))
@pytest.mark.interpreted_fused
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


# --- graph-safe packs: the chunk metadata gdn_compat attaches for FlashQLA, built by device ops -------------------

def _device_pack(lengths, slots):
    """The graph-safe pack of ``lengths`` in a buffer of ``slots`` sequences (unused slots are empty entries at the
    end), as a captured step builds it."""
    from gdn_compat.patches.gdn_thd import pack as P

    cu = torch.tensor(offsets(lengths) + [sum(lengths)] * (slots - len(lengths)), dtype=torch.int32)
    return P.device_pack({"cu_seqlens_q": cu, "cu_seqlens_kv": cu}, sum(lengths), torch.device("cpu"), 1)


METADATA_LAYOUTS = {
    "rl-like": [700, 1500, 2000, 64, 1],
    "empty entries in the middle": [700, 0, 1500, 0, 0, 2000],
    "leading empty entry": [0, 63, 64, 65, 0, 129],
    "one sequence": [4096],
    "length-1 sequences": [1, 1, 1, 1, 128],
}


@pytest.mark.parametrize("lengths", list(METADATA_LAYOUTS.values()), ids=list(METADATA_LAYOUTS))
def test_device_chunk_metadata_covers_every_token_once_within_its_sequence(lengths):
    """What FlashQLA's chunked kernels do with the metadata (flash_qla 0.1.3: each chunk-table row (sequence s,
    chunk c) handles tokens [cu[s] + 64c, min(cu[s] + 64c + 64, cu[s+1])), and masks a row past its sequence's end;
    each sequence's chunk states sit at chunk_offsets[s] + i, i < ceil(len/64), below the chunk count), replayed in
    plain Python over the attached metadata: every token is covered exactly once, by a row of its own sequence, and
    no sequence's chunk states overlap another's or exceed the count."""
    from gdn_compat._probe import FLASHQLA_METADATA
    from gdn_compat.patches.gdn_thd.fast import device_metadata

    pack = _device_pack(lengths, slots=12)
    cu = device_metadata(pack)
    size, chunk_offsets, count, table = getattr(cu, FLASHQLA_METADATA)
    assert size == 64 and cu.dtype == chunk_offsets.dtype == table.dtype == torch.int64
    bounds = cu.tolist()
    spans = [(a, b) for a, b in zip(bounds, bounds[1:])]
    want = [(a, b) for a, b in zip(offsets(lengths), offsets(lengths)[1:]) if b > a]
    assert [s for s in spans if s[1] > s[0]] == want  # the same sequences, in order
    first_empty = next((i for i, (a, b) in enumerate(spans) if a == b), len(spans))
    assert all(a == b == sum(lengths) for a, b in spans[first_empty:])  # empty entries only at the end, at T
    assert first_empty > 0  # FlashQLA's backward reads the row before an empty sequence's start
    covered = [0] * sum(lengths)
    for s, c in table.tolist():
        lo, hi = spans[s][0] + 64 * c, min(spans[s][0] + 64 * c + 64, spans[s][1])
        for t in range(lo, hi):
            covered[t] += 1
    assert covered == [1] * sum(lengths)
    states = [set(range(chunk_offsets[s], chunk_offsets[s] + -(-(b - a) // 64))) for s, (a, b) in enumerate(spans)]
    assert sum(map(len, states)) == len(set().union(*states)) and max(set().union(*states)) < count
    assert table.shape[0] == count == pack.chunks.shape[0]  # fixed by shapes: T // 64 + N + 1 rows


def test_device_chunk_metadata_rows_match_flashqlas_own_numbering_without_empty_entries():
    """Without empty entries, the real rows are FlashQLA's own table (its prepare_varlen_metadata numbers rows
    (sequence, chunk) in order; written here from its documented layout, not imported: it needs CUDA)."""
    from gdn_compat._probe import FLASHQLA_METADATA
    from gdn_compat.patches.gdn_thd.fast import device_metadata

    lengths = [129, 64, 1, 300]
    cu = device_metadata(_device_pack(lengths, slots=len(lengths)))
    _, chunk_offsets, _, table = getattr(cu, FLASHQLA_METADATA)
    want = [(s, c) for s, n in enumerate(lengths) for c in range(-(-n // 64))]
    assert [tuple(r) for r in table.tolist()[:len(want)]] == want
    assert chunk_offsets.tolist()[:len(lengths) + 1] == [0, 3, 4, 5, 10]


class CudaLike:  # what flashqla_skip reads of the input before any kernel: nothing touches the tensor (or a layer)
    is_cuda = True


class _Loc:  # the local sizes flashqla_skip reads: value heads of 128
    def __init__(self, heads):
        self.v, self.dv, self.dk = heads * 128, 128, 128


def test_a_captured_step_without_flashqlas_metadata_contract_is_refused_with_a_clear_error():
    from gdn_compat.patches.gdn_thd import fast

    with pytest.raises(RuntimeError, match="does not take a pack's chunk metadata"):
        fast.flashqla_skip(fast.Fast(flashqla=True), None, _Loc(32), CudaLike(), _device_pack([3, 5], slots=4))


def test_a_graph_safe_pack_of_few_value_heads_keeps_flas_rule_and_says_why_at_info(caplog):
    """Without the host offsets FlashQLA runs without intra-card CP, slower than fla's rule on one long document below
    32 value heads per rank (measured: docs/fast-paths.md): such a call keeps fla's rule (it never reaches the install
    checks, so an older FlashQLA is no reason to refuse it), once said at INFO; at 32 heads, and for a host pack at 16,
    the rule does not apply."""
    from gdn_compat.patches.gdn_thd import fast

    on = fast.Fast(flashqla=True)
    why = fast.flashqla_skip(on, None, _Loc(16), CudaLike(), _device_pack([3000, 5], slots=4))
    assert why is not None and "16 value heads per rank" in why and "slower than fla's" in why
    with pytest.raises(RuntimeError, match="does not take a pack's chunk metadata"):  # past the rule: the install
        fast.flashqla_skip(on, None, _Loc(32), CudaLike(), _device_pack([3000, 5], slots=4))
    from gdn_compat.patches.gdn_thd import pack as P

    host_pack = P.pack_for(packed(offsets([3000, 5])), 3005, torch.device("cpu"))
    host = fast.flashqla_skip(on, None, _Loc(16), torch.zeros(2, 1, 8), host_pack)
    assert host == "FlashQLA needs a CUDA tensor"  # a host pack at 16 heads goes on to the usual checks
    fast.forget_notes()
    with caplog.at_level(logging.INFO, logger="gdn_compat"):
        fast.note("gdn_flashqla", why)
        fast.note("gdn_flashqla", why)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert caplog.records[0].getMessage().endswith("; such calls run as with gdn_flashqla off (said once per process)")


def test_the_probe_reads_flashqlas_metadata_contract_from_its_index_helpers():
    from gdn_compat._probe import Accepts, _flashqla_metadata

    reads = '''
def prepare_chunk_indices(cu_seqlens, chunk_size):
    prepared = getattr(cu_seqlens, "_flash_qla_prepared_varlen", None)
    if prepared is not None and prepared[0] == chunk_size:
        return prepared[3]
    return _fallback(cu_seqlens, chunk_size)

def prepare_chunk_offsets(cu_seqlens, chunk_size):
    prepared = getattr(cu_seqlens, "_flash_qla_prepared_varlen", None)
    if prepared is not None and prepared[0] == chunk_size:
        return prepared[1:3]
    return _fallback_offsets(cu_seqlens, chunk_size)
'''
    assert _flashqla_metadata(reads)[0] is Accepts.YES
    older = "def prepare_chunk_indices(cu_seqlens, chunk_size):\n    return _fallback(cu_seqlens, chunk_size)\n"
    status, why = _flashqla_metadata(older)
    assert status is Accepts.NO and "read on the host" in why
    assert _flashqla_metadata("")[0] is Accepts.UNKNOWN
