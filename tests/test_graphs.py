"""The graph-safe packed path (#21), CPU part: device-built chunk indices, the PackBuffer API, device packs
through the real GatedDeltaNet and MTP roll, loud failure on bad offsets, the 0.18/0.19 opt-in switch.
Captures and replays run on a GPU: tests/gpu/test_cuda_graph_gpu.py."""

from __future__ import annotations

import pytest
import torch

import gdn_compat
from gdn_compat.patches.gdn_thd import pack as P
from tests.support.gdn import build_gdn, offsets, packed, packed_run, reference_gdn, rel, use_torch_l2norm
from tests.support.release import FACTS, MEGATRON, skip_reason

CFG = dict(dk=16, dv=16, hk=2, hv=4, kernel=4, eps=1e-5)
# a fixed budget of 160 tokens in at most 8 sequences, laid out every way a training loop may send it
TOKENS, MAX_SEQS = 160, 8
LAYOUTS = {
    "one sequence fills the pack": [0, 160],
    "length-1 sequences": [0, 1, 2, 3, 100, 159, 160],
    "empty entries in the middle and at the end": [0, 64, 64, 65, 65, 129, 160, 160],
    "chunk edges 63/64/65": [0, 1, 64, 128, 193 - 33],
}


def _graph_switch() -> dict[str, bool]:
    """apply() switches that put this release's packed GDN on gdn_compat's graph-safe path."""
    return {"gdn_thd_graph_safe": True} if FACTS.gdn_thd == "native" else {}


def _needs_graph_safe_gdn():
    reason = skip_reason("gdn_thd") if FACTS.gdn_thd != "native" else None
    if FACTS.gdn_thd == "native" and FACTS.gdn_native_shape is False:
        reason = f"megatron-core {MEGATRON}: unknown native GDN shape"
    if FACTS.gdn_thd not in ("native", "refuses"):
        reason = f"megatron-core {MEGATRON} has no GatedDeltaNet"
    if reason:
        pytest.skip(reason)


def _by_enumeration(cu: list[int], rows: int) -> list[list[int]]:
    """(sequence, chunk) per 64-token chunk, by walking the sequences; spare rows at the last sequence."""
    out = [[i, c] for i, (a, b) in enumerate(zip(cu, cu[1:])) for c in range(-(-(b - a) // 64))]
    return out + [[len(cu) - 2, 0]] * (rows - len(out))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_device_chunk_indices_enumerate_every_chunk_and_point_spare_rows_at_the_empty_tail(name):
    cu = LAYOUTS[name] + [TOKENS]  # the appended empty sequence device_pack adds
    rows = TOKENS // 64 + len(LAYOUTS[name])
    got = P.chunk_indices(torch.tensor(cu, dtype=torch.int32), rows)
    assert got.dtype == torch.int32 and got.shape == (rows, 2)
    assert got.tolist() == _by_enumeration(cu, rows)


def test_host_pack_chunk_indices_are_fla_prepare_chunk_indices():
    fla_index = pytest.importorskip("fla.ops.utils.index")
    cu = torch.tensor([0, 1, 64, 129, 300, 301], dtype=torch.int32)
    want = fla_index.prepare_chunk_indices(cu, 64, cu_seqlens_cpu=cu)
    exact = sum(-(-n // 64) for n in torch.diff(cu).tolist())
    assert torch.equal(P.chunk_indices(cu, exact), want)


def test_any_layout_fits_the_fixed_row_count():
    # the worst case for T // 64 + N + 1 rows: every sequence one token past a chunk edge
    lengths = [65] * 7 + [160 * 7 - 65 * 7]
    cu = offsets(lengths)
    rows = cu[-1] // 64 + len(cu)
    table = P.chunk_indices(torch.tensor(cu + [cu[-1]]), rows).tolist()
    real = sum(-(-n // 64) for n in lengths)
    assert real < rows and table[:real] == _by_enumeration(cu, real)


# -- the PackBuffer API ----------------------------------------------------------------------------


@pytest.fixture
def graph_gdn(megatron_cpu):
    _needs_graph_safe_gdn()
    with gdn_compat.applied(**_graph_switch()) as report:
        assert {"gdn_thd", "gdn_thd_graph_safe"} & set(report.applied)
        yield megatron_cpu


def test_load_refuses_another_token_count_or_more_sequences_before_any_kernel(graph_gdn):
    buf = gdn_compat.graphs.PackBuffer(TOKENS, MAX_SEQS, device=graph_gdn)
    buf.load([0, 100, 160])
    before = buf.cu_seqlens.clone()
    with pytest.raises(ValueError, match=r"holds 150 tokens but the buffer \(and the captured graph\) holds exactly 160"):
        buf.load([0, 100, 150])
    with pytest.raises(ValueError, match=r"has 9 sequences but the buffer \(and the captured graph\) holds at most 8"):
        buf.load(list(range(0, 160, 20)) + [155, 160])
    with pytest.raises(ValueError, match=r"must start at 0, not decrease.*\[0, 100, 90, 160\]"):
        buf.load([0, 100, 90, 160])
    with pytest.raises(ValueError, match="needs cu_seqlens_padded|got cu_seqlens_padded"):
        buf.load([0, 160], [0, 160])
    assert torch.equal(buf.cu_seqlens, before)  # nothing written by a refused load
    assert buf.cu_seqlens.tolist() == [0, 100] + [160] * 7


def test_pad_to_appends_one_padding_sequence_up_to_the_budget():
    assert gdn_compat.graphs.pad_to([0, 50, 120], 160) == [0, 50, 120, 160]
    assert gdn_compat.graphs.pad_to(torch.tensor([0, 160]), 160) == [0, 160]
    with pytest.raises(ValueError, match="holds 170 tokens, more than the budget 160"):
        gdn_compat.graphs.pad_to([0, 170], 160)


def test_packbuffer_needs_the_graph_safe_gdn_applied(megatron_cpu):
    with gdn_compat.applied(gdn_thd=False, gdn_thd_graph_safe=False):
        with pytest.raises(RuntimeError, match="needs gdn_compat's packed GDN path applied first"):
            gdn_compat.graphs.PackBuffer(TOKENS, MAX_SEQS, device=megatron_cpu)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_packbuffer_layout_gives_what_the_host_path_gives_for_its_sequences(graph_gdn, monkeypatch, name):
    use_torch_l2norm(monkeypatch)
    layer = build_gdn(graph_gdn)
    buf = gdn_compat.graphs.PackBuffer(TOKENS, MAX_SEQS, device=graph_gdn)
    buf.load(LAYOUTS[name])
    x = torch.randn(TOKENS, 1, 64, generator=torch.Generator().manual_seed(5)).to(graph_gdn)
    dy = torch.randn(TOKENS, 1, 64, generator=torch.Generator().manual_seed(6)).to(graph_gdn)
    static = packed_run(layer, x, buf.params, dy)
    compact = sorted(set(LAYOUTS[name]))  # the same pack without empty entries: the host (eager) path
    host = packed_run(layer, x, packed(compact), dy)
    assert torch.equal(static[0], host[0]) and torch.equal(static[1], host[1])
    assert all(torch.equal(static[2][k], host[2][k]) for k in host[2])
    spans = list(zip(compact, compact[1:]))
    params = {n: p.detach() for n, p in layer.named_parameters()}
    assert rel(static[0][:, 0], reference_gdn(params, CFG, x[:, 0], spans)) < 1e-5  # no state crosses a boundary


def test_offsets_written_past_the_api_fail_loudly_not_silently(graph_gdn):
    layer = build_gdn(graph_gdn)
    buf = gdn_compat.graphs.PackBuffer(TOKENS, MAX_SEQS, device=graph_gdn)
    x = torch.randn(TOKENS, 1, 64).to(graph_gdn)
    for bad in ([0, 100, 90] + [160] * 6, [0, 100] + [150] * 7, [3, 100] + [160] * 7):
        buf.cu_seqlens.copy_(torch.tensor(bad))  # bypasses load()'s host checks
        with pytest.raises(RuntimeError, match="invalid offsets for a pack of 160 tokens"):
            layer(x, None, packed_seq_params=buf.params)


def test_a_context_parallel_pack_cannot_take_the_graph_safe_path_and_is_told_what_works(graph_gdn):
    """Every CP mode (the head all-to-all, gdn_cp_state's state passing) builds its pack here: a PackBuffer's offsets
    at cp > 1 are refused before any mode lays out ranks, never run as if they were a host pack."""
    buf = gdn_compat.graphs.PackBuffer(TOKENS, MAX_SEQS, device=graph_gdn)
    buf.load([0, 64, 160])
    assert P.pack_for(buf.params, TOKENS, torch.device(graph_gdn), 1).cu_cpu is None  # cp = 1: the device pack
    for cp in (2, 4):
        with pytest.raises(NotImplementedError, match=f"context parallel size {cp}") as err:
            P.pack_for(buf.params, TOKENS, torch.device(graph_gdn), cp)
        assert "plain PackedSeqParams" in str(err.value) and "run eagerly" not in str(err.value)


def test_a_padded_pack_pads_to_the_budget_and_loads(graph_gdn):
    real, slots = [0, 5, 12], [0, 8, 16]
    got_real, got_slots = gdn_compat.graphs.pad_to(real, 32, padded=slots)
    assert (got_real, got_slots) == ([0, 5, 12, 28], [0, 8, 16, 32])  # the padding sequence fills its slot
    buf = gdn_compat.graphs.PackBuffer(32, 4, device=graph_gdn, padded=True)
    buf.load(got_real, got_slots)
    assert buf.cu_seqlens_padded.tolist() == [0, 8, 16, 32, 32]
    with pytest.raises(ValueError, match=r"pad_to\(real, tokens, padded=slots\)"):
        buf.load(gdn_compat.graphs.pad_to(real, 32), gdn_compat.graphs.pad_to(slots, 32))


def test_offsets_as_numpy_integers_load_and_bad_inputs_name_themselves(graph_gdn):
    np = pytest.importorskip("numpy")
    buf = gdn_compat.graphs.PackBuffer(TOKENS, MAX_SEQS, device=graph_gdn)
    buf.load(np.array([0, 100, 160], dtype=np.int64))
    assert buf.cu_seqlens.tolist()[:3] == [0, 100, 160]
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D .* got NoneType: None"):
        buf.load(None)
    with pytest.raises(TypeError, match="must hold integers"):
        buf.load([0, 100.0, 160])
    with pytest.raises(TypeError, match="dtype must be torch.int32 or torch.int64.*torch.float32"):
        gdn_compat.graphs.PackBuffer(TOKENS, MAX_SEQS, device=graph_gdn, dtype=torch.float32)
    for bad in (torch.int16, torch.bool):
        with pytest.raises(TypeError, match="dtype must be"):
            gdn_compat.graphs.PackBuffer(TOKENS, MAX_SEQS, device=graph_gdn, dtype=bad)
    with pytest.raises(TypeError, match="tokens must be an int"):
        gdn_compat.graphs.pad_to([0, 10], 160.0)


def test_capture_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        gdn_compat.graphs.capture(lambda: None)


def test_the_mtp_roll_of_a_padded_packbuffer_equals_the_host_roll(graph_gdn):
    if gdn_compat.report()["mtp_packed_roll"].status != "applied":
        pytest.skip(f"mtp_packed_roll: {gdn_compat.report()['mtp_packed_roll'].reason}")
    from megatron.core.transformer import multi_token_prediction as mtp

    real, slots = [0, 5, 6, 6, 17, 21], [0, 8, 12, 12, 24, 28]  # a length-1, an empty, padded slots
    buf = gdn_compat.graphs.PackBuffer(32, 8, device=graph_gdn, padded=True)
    buf.load(real + [25], slots + [32])
    ids = torch.arange(1, 33)[None].to(graph_gdn)
    rolled, _ = mtp._roll_tensor_packed_seq(ids, -1, -1, buf.params, None)
    host = packed(real + [25], slots + [32])
    want, _ = mtp._roll_tensor_packed_seq(ids, -1, -1, host, None)
    assert torch.equal(rolled, want)
    assert int((rolled != 0).sum()) == sum(max(b - a - 1, 0) for a, b in zip(real + [25], (real + [25])[1:]))


# -- the 0.18/0.19 opt-in switch ---------------------------------------------------------------------


def test_the_graph_safe_switch_is_off_by_default_and_names_how_to_turn_it_on():
    [rec] = [r for r in gdn_compat.plan(FACTS) if r.name == "gdn_thd_graph_safe"]
    assert rec.status == "skipped"
    if FACTS.gdn_thd == "native" and FACTS.gdn_native_shape:
        assert "apply(gdn_thd_graph_safe=True)" in rec.reason and "GDN_COMPAT_ENABLE" in rec.reason
        [on] = [r for r in gdn_compat.plan(FACTS, gdn_thd_graph_safe=True) if r.name == "gdn_thd_graph_safe"]
        assert on.status == "would_apply" if FACTS.fla_varlen.graph_safe else on.status == "skipped"
    elif FACTS.gdn_thd == "refuses":
        assert "no native THD; gdn_thd's packed path is graph-safe there" in rec.reason


def test_gdn_compat_enable_names_only_opt_in_patches(monkeypatch):
    monkeypatch.setenv("GDN_COMPAT_ENABLE", "gdn_thd")
    with pytest.raises(ValueError, match=r"GDN_COMPAT_ENABLE='gdn_thd' names \['gdn_thd'\], which are not opt-in"):
        gdn_compat.plan(FACTS)
    monkeypatch.setenv("GDN_COMPAT_ENABLE", "gdn_thd_graph_safe")
    [rec] = [r for r in gdn_compat.plan(FACTS) if r.name == "gdn_thd_graph_safe"]
    assert "opt-in" not in rec.reason


def test_unpacked_calls_stay_the_release_own_forward_with_the_switch(megatron_cpu, monkeypatch):
    if FACTS.gdn_thd != "native":
        pytest.skip(f"megatron-core {MEGATRON}: the switch is for native THD (0.18/0.19)")
    use_torch_l2norm(monkeypatch)
    layer = build_gdn(megatron_cpu, deterministic=True)  # the release's unpacked path runs on the CPU so
    x = torch.randn(24, 2, 64).to(megatron_cpu)
    before = packed_run(layer, x, None)
    with gdn_compat.applied(gdn_thd_graph_safe=True) as report:
        assert report["gdn_thd_graph_safe"].status == "applied"
        after = packed_run(layer, x, None)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
