"""mtp_checkpoint_args (#13 part 1) on the release's real MultiTokenPredictionLayer (0.15-0.17).

The layer comes from a real GPTModel with an MoE MTP layer and full recompute; only its
``_proj_and_transformer_layer`` is replaced by a recording stand-in whose output depends on the
packed offsets (the local attention has no THD path on the CPU, so the real layer cannot run a
pack here). End to end without a pack, ``tests/test_mtp_padding_mask.py`` checks the real model's
loss and gradients with recompute against no recompute on every release, this patch applied.
"""

from __future__ import annotations

import pytest
import torch

import gdn_compat
from tests.support.gdn import packed
from tests.support.mtp import build_gpt
from tests.support.release import skip_reason

pytestmark = pytest.mark.skipif(skip_reason("mtp_checkpoint_args") is not None,
                                reason=str(skip_reason("mtp_checkpoint_args")))


@pytest.fixture
def layer(megatron_cpu):
    mtp_layer = build_gpt(recompute=True, device=megatron_cpu).mtp.layers[0]
    calls = []

    def proj(hidden_states, decoder_input, attention_mask=None, context=None, context_mask=None,
             rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
             inference_params=None, packed_seq_params=None, sequence_len_offset=None):
        calls.append((torch.is_grad_enabled(), packed_seq_params))
        scale = 1.0 if packed_seq_params is None else 1.0 + packed_seq_params.cu_seqlens_q.float().sum()
        return (hidden_states * decoder_input).tanh() * scale

    mtp_layer._proj_and_transformer_layer = proj
    return mtp_layer, calls


def _kwargs(device, psp):
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(6, 1, 8, generator=gen).to(device).requires_grad_(True)
    d = torch.randn(6, 1, 8, generator=gen).to(device).requires_grad_(True)
    return dict(hidden_states=h, decoder_input=d, attention_mask=None, context=None, context_mask=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                inference_params=None, packed_seq_params=psp, sequence_len_offset=None)


def _step(mtp_layer, kw, checkpointed=True):
    forward = mtp_layer._proj_and_transformer_layer
    out = mtp_layer._checkpointed_forward(forward, **kw) if checkpointed else forward(**kw)
    out.sum().backward()
    return out.detach(), kw["hidden_states"].grad.clone(), kw["decoder_input"].grad.clone()


def test_unpatched_release_refuses_packed_params_in_the_recompute(layer, megatron_cpu):
    mtp_layer, _ = layer
    with pytest.raises(TypeError, match="save_for_backward can only save variables.*PackedSeqParams"):
        _step(mtp_layer, _kwargs(megatron_cpu, packed([0, 2, 6])))


def test_patched_recompute_sees_the_same_packed_params_and_matches_no_recompute(layer, megatron_cpu):
    mtp_layer, calls = layer
    psp = packed([0, 2, 6])
    with gdn_compat.applied() as report:
        assert report["mtp_checkpoint_args"].status == "applied"
        got = _step(mtp_layer, _kwargs(megatron_cpu, psp))
    assert [grad for grad, _ in calls] == [False, True]  # the forward without grad, then the recompute
    assert all(p is psp for _, p in calls)
    ref = _step(mtp_layer, _kwargs(megatron_cpu, psp), checkpointed=False)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_without_a_pack_the_patch_computes_what_the_release_does(layer, megatron_cpu):
    mtp_layer, _ = layer
    ref = _step(mtp_layer, _kwargs(megatron_cpu, None))
    with gdn_compat.applied():
        got = _step(mtp_layer, _kwargs(megatron_cpu, None))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_fp8_branch_keeps_te_checkpoint_with_the_release_rng_tracker_and_tp_group(layer, megatron_cpu, monkeypatch):
    import sys

    import megatron.core.extensions.transformer_engine as te_ext
    from megatron.core import tensor_parallel

    mtp_layer, calls = layer
    release = sys.modules[type(mtp_layer).__module__]
    seen = []

    def te_checkpoint(function, distribute, rng_tracker, tp_group, *args):  # TE stand-in
        seen.append((rng_tracker, tp_group, [type(a).__name__ for a in args]))
        return tensor_parallel.checkpoint(function, distribute, *args)

    monkeypatch.setattr(te_ext, "te_checkpoint", te_checkpoint, raising=False)
    monkeypatch.setattr(mtp_layer.config, "fp8", "e4m3")
    psp = packed([0, 2, 6])
    with gdn_compat.applied():
        _step(mtp_layer, _kwargs(megatron_cpu, psp))
    [(rng, group, kinds)] = seen
    assert rng is release.tensor_parallel.random.get_cuda_rng_tracker
    assert group is release.parallel_state.get_tensor_model_parallel_group()
    assert "PackedSeqParams" not in kinds  # bound in the closure, not saved
    assert [grad for grad, _ in calls] == [False, True] and all(p is psp for _, p in calls)


def _fp8_step(mtp_layer, kw, checkpointed=True):
    """One step whose loss also has terms outside the MTP layer (as a real one does: the LM loss), so a
    lost MTP gradient shows as a missing contribution, not as an error."""
    forward = mtp_layer._proj_and_transformer_layer
    out = mtp_layer._checkpointed_forward(forward, **kw) if checkpointed else forward(**kw)
    (out.sum() + kw["hidden_states"].sum() + kw["decoder_input"].sum()).backward()
    return kw["hidden_states"].grad.clone(), kw["decoder_input"].grad.clone()


@pytest.fixture
def te_fp8(layer, monkeypatch):
    import megatron.core.extensions.transformer_engine as te_ext

    from tests.support.mtp import te_like_checkpoint

    monkeypatch.setattr(te_ext, "te_checkpoint", te_like_checkpoint, raising=False)
    monkeypatch.setattr(layer[0].config, "fp8", "e4m3")
    return layer[0]


def test_unpatched_fp8_recompute_loses_the_mtp_gradients_without_an_error(te_fp8, megatron_cpu):
    ref = _fp8_step(te_fp8, _kwargs(megatron_cpu, None), checkpointed=False)
    got = _fp8_step(te_fp8, _kwargs(megatron_cpu, None))  # no pack: the hole is fp8's, not packing's
    assert all(torch.equal(g, torch.ones_like(g)) for g in got)  # only the outside terms' gradient arrived
    assert not any(torch.equal(r, torch.ones_like(r)) for r in ref)


@pytest.mark.parametrize("pack", [None, [0, 2, 6]], ids=["unpacked", "packed"])
def test_patched_fp8_recompute_keeps_the_mtp_gradients(te_fp8, megatron_cpu, pack):
    psp = None if pack is None else packed(pack)
    ref = _fp8_step(te_fp8, _kwargs(megatron_cpu, psp), checkpointed=False)
    with gdn_compat.applied():
        got = _fp8_step(te_fp8, _kwargs(megatron_cpu, psp))
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
