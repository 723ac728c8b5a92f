"""gdn_thd_zero_length (#36, CPU part): the probe, the decision, the offsets transformation, and the route.

fla's kernels cannot run on the CPU, and the fla-core that imports beside this suite's Triton (0.6.0) numbers
chunks right; so the hole itself is shown on an H200 (tests/gpu/test_zero_length_gpu.py). Here: the probe reads
fla's table right for the installed fla and for a table numbered the 0.4.x way; the host pack of offsets with
empty entries is the compacted pack; and on 0.18/0.19, with the fact set as fla-core 0.4.x would set it, exactly
the packs with empty entries leave the release's native path (fla's varlen kernels replaced by per-sequence torch).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gdn_compat
from gdn_compat import _probe
from gdn_compat._probe import Accepts
from gdn_compat.patches import gdn_thd_zero_length
from gdn_compat.patches.gdn_thd import PACKS
from gdn_compat.patches.gdn_thd.own import STANDS_FOR_FLA
from gdn_compat.patches.gdn_thd.pack import device_pack, pack_for
from tests.support.gdn import build_gdn, fla_on_cpu, offsets, packed, packed_run, rel
from tests.support.release import FACTS, MEGATRON

LENGTHS = [0, 5, 0, 0, 70, 1, 0, 9, 0]  # empty first, in the middle, several in a row, last (the layout)
ALL_BUT_ONE = [0, 0, 85, 0]


def _numbered_by_first_chunks(cu, chunk_size):
    """A chunk table numbered as fla-core 0.4.x numbers it: a chunk's sequence is the count of sequence-opening
    chunks so far, so an empty sequence (which opens none) takes no number."""
    counts = [-(-(b - a) // chunk_size) for a, b in zip(cu.tolist(), cu.tolist()[1:])]
    rows, opened = [], -1
    for n in counts:
        for c in range(n):
            opened += c == 0
            rows.append([opened, c])
    return torch.tensor(rows, dtype=cu.dtype)


def test_the_probe_reads_the_installed_fla_chunk_table():
    if FACTS.fla is None or FACTS.fla_error:
        pytest.skip(f"fla not importable here: {FACTS.fla_error}")
    from fla.ops.utils.index import prepare_chunk_indices

    cu = torch.tensor(_probe.ZERO_LENGTH_PACK)
    right = prepare_chunk_indices(cu, 64).tolist() == _probe.ZERO_LENGTH_CHUNKS
    assert FACTS.fla_zero_length is (Accepts.YES if right else Accepts.NO), FACTS.notes["fla_zero_length"]


def test_the_probe_finds_a_table_numbered_the_old_way_wrong_and_a_failing_one_unknown():
    assert _probe.zero_length(_numbered_by_first_chunks)[0] is Accepts.NO
    assert _probe.zero_length(lambda cu, size: 1 / 0)[0] is Accepts.UNKNOWN
    # the pack the probe uses does separate the two readings
    cu = torch.tensor(_probe.ZERO_LENGTH_PACK)
    assert _numbered_by_first_chunks(cu, 64).tolist() != _probe.ZERO_LENGTH_CHUNKS


@pytest.mark.parametrize("found", [Accepts.NO, Accepts.YES, Accepts.UNKNOWN])
def test_the_patch_applies_exactly_where_the_native_path_meets_a_wrong_table(found):
    facts = dataclasses.replace(FACTS, fla_zero_length=found)
    reason = gdn_thd_zero_length.decide(facts)
    wanted = FACTS.gdn_thd == "native" and FACTS.gdn_native_shape and found is Accepts.NO
    assert (reason is None) is wanted, reason
    if reason is not None:
        assert MEGATRON is None or MEGATRON in reason or "unknown" in reason or "not patched" in reason, reason


@pytest.mark.parametrize("lengths", [LENGTHS, ALL_BUT_ONE], ids=["scattered", "all-but-one"])
def test_the_host_pack_of_offsets_with_empty_entries_is_the_compacted_pack(lengths):
    PACKS.clear()
    total = sum(lengths)
    got = pack_for(packed(offsets(lengths)), total, torch.device("cpu"))
    want = pack_for(packed(offsets([n for n in lengths if n])), total, torch.device("cpu"))
    assert got.empty_entries and not want.empty_entries
    assert got.cu.tolist() == want.cu.tolist() and got.spans == want.spans
    assert torch.equal(got.chunks, want.chunks)


@pytest.mark.parametrize("lengths", [LENGTHS, ALL_BUT_ONE], ids=["scattered", "all-but-one"])
def test_the_graph_safe_chunk_table_numbers_every_chunk_with_its_own_sequence(lengths):
    cu = offsets(lengths)
    given = {"cu_seqlens_q": torch.tensor(cu, dtype=torch.int32)}
    pack = device_pack(given, cu[-1], torch.device("cpu"), 1)
    seen = []
    for seq, chunk in pack.chunks.tolist():
        start, end = pack.cu[seq].item(), pack.cu[seq + 1].item()
        if end > start:  # rows past the real chunks point at the appended empty sequence
            seen += [t for t in range(start + 64 * chunk, min(end, start + 64 * (chunk + 1)))]
    assert seen == list(range(cu[-1]))  # every token once, by a chunk of its own sequence


@pytest.fixture
def hole(megatron_cpu, monkeypatch):
    """0.18/0.19 with the fact as fla-core 0.4.x sets it, and fla's varlen kernels as per-sequence torch (so the
    release's native path runs on the CPU); yields the count of calls that reached the release's own kernels."""
    if FACTS.gdn_thd != "native":
        pytest.skip(f"{FACTS.release}: gdn_thd drops zero-length entries itself (tests/test_gdn_thd.py)")
    monkeypatch.setattr(_probe.fla, "zero_length", lambda: (Accepts.NO, "as fla-core 0.4.x numbers them"))
    fla_on_cpu(monkeypatch.setattr)
    import sys

    calls = {"native": 0}
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core.ssm.gated_delta_net") and hasattr(module, "chunk_gated_delta_rule"):
            rule = module.chunk_gated_delta_rule

            def counted(*args, _rule=rule, **kwargs):
                calls["native"] += 1
                return _rule(*args, **kwargs)

            # still fla's rule, counted (as fla_on_cpu's stand-in says): any other rule would leave every layer to the
            # release (gdn_compat/patches/gdn_thd/own.py)
            setattr(counted, STANDS_FOR_FLA, True)
            monkeypatch.setattr(module, "chunk_gated_delta_rule", counted)
    PACKS.clear()
    yield calls
    PACKS.clear()


@pytest.mark.parametrize("lengths", [LENGTHS, ALL_BUT_ONE], ids=["scattered", "all-but-one"])
def test_exactly_the_packs_with_empty_entries_leave_the_release_path(hole, lengths):
    layer = build_gdn("cpu")  # after the fixture: 0.19 binds the (counted) rule to the layer at construction
    x = torch.randn(sum(lengths), 1, 64, generator=torch.Generator().manual_seed(4))
    compact = [n for n in lengths if n]
    with gdn_compat.applied() as report:
        assert report["gdn_thd_zero_length"].status == "applied", report["gdn_thd_zero_length"]
        before = hole["native"]
        want = packed_run(layer, x, packed(offsets(compact)))  # the release's own path
        assert hole["native"] == before + 1
        got = packed_run(layer, x, packed(offsets(lengths)))  # gdn_compat's packed path
        assert hole["native"] == before + 1
    assert rel(got[0], want[0]) < 1e-5 and rel(got[1], want[1]) < 1e-5
    assert all(rel(got[2][n], want[2][n]) < 1e-5 for n in want[2])


def test_a_subclass_the_packed_path_would_ignore_gets_an_error_not_garbage(hole):
    layer = build_gdn("cpu")
    name = next(n for n in ("_prepare_input_for_gated_delta_rule", "_prepare_qkv_for_gated_delta_rule")
                if hasattr(type(layer), n))
    original = getattr(type(layer), name)
    layer.__class__ = type("FrameworkGDN", (type(layer),), {name: lambda self, *a, **k: original(self, *a, **k)})
    x = torch.randn(sum(LENGTHS), 1, 64)
    with gdn_compat.applied(), pytest.raises(ValueError, match=f"zero-length entries.*overrides {name}"):
        layer(x, None, packed_seq_params=packed(offsets(LENGTHS)))
