"""Zero-length entries in packed offsets (#36) on an H200, bf16, the real kernels (fla, FlashQLA, gdn_compat's Triton).

A pack whose offsets repeat a value (an empty document first, in the middle, several in a row, last; or every
document but one empty) holds the same tokens, in the same layout, as the pack with those entries removed: every
packed GDN call must give it the same output and gradients. On 0.18/0.19 with an fla whose ``prepare_chunk_indices``
numbers chunks wrong after an empty entry (fla-core 0.4.x, 0.5.0; ``Facts.fla_zero_length``) the release's own forward
does not; ``gdn_thd_zero_length`` (default on) takes exactly those calls. The first test shows the hole unpatched.
"""

from __future__ import annotations

import pytest
import torch

import gdn_compat
from gdn_compat.patches.gdn_thd import PACKS
from tests.support import model as M
from tests.support.gdn import QWEN3_NEXT, build_gdn, offsets, packed, packed_run, rel
from tests.support.release import FACTS, MEGATRON

PACKS_WITH_EMPTIES = {
    "first-middle-consecutive-last": [0, 100, 0, 0, 257, 1, 0, 640, 0],  # the pack: 998 tokens
    "all-but-one": [0, 0, 998, 0],
}
SWITCHES = {"default": {}, "gdn_fused": {"gdn_fused": True}, "gdn_flashqla": {"gdn_flashqla": True},
            "both": {"gdn_fused": True, "gdn_flashqla": True}}
NATIVE = FACTS.gdn_thd == "native"
HOLE = NATIVE and FACTS.fla_zero_length == "no"


def _gdn_ready(megatron_cpu):
    assert megatron_cpu == "cuda"
    if FACTS.gdn == "absent":
        pytest.skip(f"{FACTS.release} has no GatedDeltaNet")


def _psp(lengths):
    psp = packed(offsets(lengths))
    psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
    return psp


@pytest.fixture(scope="module")
def layer_inputs(megatron_cpu):
    _gdn_ready(megatron_cpu)
    m = build_gdn(device="cuda", dtype=torch.bfloat16, **QWEN3_NEXT)
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(998, 1, QWEN3_NEXT["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    return m, x, dy


def _worst(a, b) -> tuple[float, float, float]:
    """(output, input grad, worst parameter grad) relative errors of run ``a`` against run ``b``; inf if not finite."""
    def err(p, q):
        return rel(p, q) if torch.isfinite(p).all() else float("inf")

    return err(a[0], b[0]), err(a[1], b[1]), max(err(a[2][n], b[2][n]) for n in b[2])


@pytest.mark.skipif(not HOLE, reason=f"{FACTS.release} with {FACTS.fla}: the release's own forward has no zero-length "
                                     f"hole to show (fla_zero_length={FACTS.fla_zero_length}, THD {FACTS.gdn_thd})")
def test_the_release_alone_gets_empty_entries_wrong(layer_inputs):
    m, x, dy = layer_inputs
    lengths = PACKS_WITH_EMPTIES["first-middle-consecutive-last"]
    want = packed_run(m, x, _psp([n for n in lengths if n]), dy)  # the release, no empty entries: right
    got = packed_run(m, x, _psp(lengths), dy)
    errors = _worst(got, want)
    print(f"\n[zero-length {MEGATRON} {FACTS.fla} release alone] out / dx / worst grad rel: {errors}")
    assert max(errors) > 0.1  # NaN, or finite and wrong: the hole gdn_thd_zero_length closes


@pytest.mark.parametrize("pack", sorted(PACKS_WITH_EMPTIES))
@pytest.mark.parametrize("switches", sorted(SWITCHES))
def test_empty_entries_give_the_result_of_the_pack_without_them(layer_inputs, pack, switches):
    m, x, dy = layer_inputs
    lengths = PACKS_WITH_EMPTIES[pack]
    with gdn_compat.applied(**SWITCHES[switches]) as report:
        PACKS.clear()
        want = packed_run(m, x, _psp([n for n in lengths if n]), dy)
        got = packed_run(m, x, _psp(lengths), dy)
    applied = sorted(r.name for r in report.records if r.status == "applied" and r.name.startswith("gdn_"))
    missing = sorted(set(SWITCHES[switches]) - set(applied))
    if missing:
        pytest.skip(f"{missing} not applied here: {[report[n].reason for n in missing]}")
    errors = _worst(got, want)
    print(f"\n[zero-length {MEGATRON} {FACTS.fla} {switches} {pack}] applied {applied}: out / dx / worst grad rel "
          f"{errors}, bitwise {torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])}")
    # the same kernels over the same chunks: measured bitwise; the bound is the per-sequence bar of the THD tests
    assert errors[0] <= 8e-3 and errors[1] <= 3e-4 and errors[2] <= 1e-2, errors


SHAPE = dict(hidden=2048, dk=128, dv=128, hk=16, hv=32, ffn=4096)
MODEL_LENGTHS = [0, 300, 0, 0, 700, 1, 0, 1000, 0]


@pytest.mark.parametrize("mode", ["mtp", "deterministic"])
def test_a_model_trains_the_same_on_a_pack_with_empty_entries(megatron_cpu, monkeypatch, mode):
    """Two GDN + SwiGLU layers (+ an MTP layer whose inner layer is GDN), bf16: loss and every gradient on the pack
    with empty entries against the same tokens packed without them."""
    _gdn_ready(megatron_cpu)
    import torch._dynamo.config as dynamo_config

    limit = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    monkeypatch.setattr(dynamo_config, limit, 64)  # megatron's compiled helpers see many shapes in one process
    results = {}
    with gdn_compat.applied():
        model = M.build(M.config(shape=SHAPE, bf16=True, layers=2, mtp=mode == "mtp",
                                 deterministic=mode == "deterministic"), seed=7, device="cuda")
        batch = M.packed_batch([n for n in MODEL_LENGTHS if n], None)  # the tokens, once
        ids, pos, labels, mask = (batch[k].cuda()[None] for k in ("ids", "positions", "labels", "mask"))
        for name, lengths in (("empties", MODEL_LENGTHS), ("compact", [n for n in MODEL_LENGTHS if n])):
            PACKS.clear()
            psp = batch["psp"]
            cu = torch.tensor(offsets(lengths), dtype=torch.int32, device="cuda")
            psp.cu_seqlens_q = psp.cu_seqlens_kv = cu
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels, loss_mask=mask,
                         packed_seq_params=psp)
            (loss.float()[0] * mask[0]).sum().backward()
            results[name] = {"loss": loss.detach().float(), **{n: p.grad.float().clone()
                                                                for n, p in model.named_parameters()}}
    got, want = results["empties"], results["compact"]
    errors = {k: rel(got[k], want[k]) if torch.isfinite(got[k]).all() else float("inf") for k in want}
    worst = max((v, k) for k, v in errors.items() if k != "loss")
    print(f"\n[zero-length model {MEGATRON} {FACTS.fla} {mode}] loss rel {errors['loss']:.2e}, worst grad rel "
          f"{worst[0]:.2e} ({worst[1]}), bitwise {all(torch.equal(got[k], want[k]) for k in want)}")
    assert errors["loss"] < 1e-3 and worst[0] < 2e-2, errors
