"""mtp_padding_mask: end to end on a real GPTModel with an MoE MTP layer, and per branch."""

from __future__ import annotations

import contextlib
import copy
import inspect

import pytest
import torch

import gdn_compat
from tests.support.mtp import batch, build_gpt, loss_and_grads
from tests.support.release import FACTS, MEGATRON, skip_reason

NEEDED = skip_reason("mtp_padding_mask") is None


def _gpt_takes_padding_mask() -> bool:
    from megatron.core.models.gpt import GPTModel

    return "padding_mask" in inspect.signature(GPTModel.forward).parameters


@pytest.fixture
def models(megatron_cpu):
    if FACTS.mtp == "absent":
        pytest.skip(f"megatron-core {MEGATRON} has no MTP")
    plain = build_gpt(recompute=False, device=megatron_cpu)
    full = build_gpt(recompute=True, device=megatron_cpu)
    full.load_state_dict(plain.state_dict())
    return plain, full, batch(device=megatron_cpu)


def test_full_recompute_gives_the_same_loss_and_gradients_as_no_recompute(models):
    plain, full, data = models
    use_mask = _gpt_takes_padding_mask()
    with gdn_compat.applied() as report:
        assert report["mtp_padding_mask"].status == ("applied" if NEEDED else "skipped")
        loss0, grads0 = loss_and_grads(plain, data, use_mask)
        loss1, grads1 = loss_and_grads(full, data, use_mask)
        grads_unmasked = loss_and_grads(full, data, use_mask=False)[1] if use_mask else None
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and any("mtp" in n for n in grads0)
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name
    if grads_unmasked is not None:  # the mask must matter, or this test proves nothing about it arriving
        assert any(not torch.equal(grads0[n], grads_unmasked[n]) for n in grads0)


@pytest.mark.skipif(not NEEDED, reason=str(skip_reason("mtp_padding_mask")))
def test_unpatched_release_dies_with_the_padding_mask_type_error(models):
    _, full, data = models
    with pytest.raises(TypeError, match="unexpected keyword argument 'padding_mask'"):
        loss_and_grads(full, data)


# -- per branch, with the release's real MultiTokenPredictionLayer -----------------------------

branch = pytest.mark.skipif(not NEEDED, reason=str(skip_reason("mtp_padding_mask")))


@pytest.fixture
def layer(models):
    """The real MTP layer; only _proj_and_transformer_layer is replaced by a recording stand-in."""
    _, full, _ = models
    mtp_layer = full.mtp.layers[0]
    mtp_layer.config = copy.copy(mtp_layer.config)
    calls = []

    def proj(**kw):
        proj.context = kw.get("context")
        mask = kw.get("padding_mask")
        calls.append((torch.is_grad_enabled(), None if mask is None else mask.clone()))
        scale = 1.0 if mask is None else 1.0 + mask.float().sum()
        return kw["hidden_states"] * kw["decoder_input"] * scale

    mtp_layer._proj_and_transformer_layer = proj
    return mtp_layer, calls


def _inputs(device, mask=True):
    h = torch.randn(6, 2, 8, device=device, requires_grad=True)
    d = torch.randn(6, 2, 8, device=device, requires_grad=True)
    pm = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.bool, device=device).t() if mask else None
    return h, d, pm


def _forward_backward(layer, h, d, pm, **extra):
    out = layer._checkpointed_forward(hidden_states=h, decoder_input=d, attention_mask=None, padding_mask=pm, **extra)
    out.sum().backward()
    return out.detach(), h.grad.clone(), d.grad.clone()


@branch
def test_mask_reaches_forward_and_recompute_through_tensor_parallel_checkpoint(layer, megatron_cpu):
    mtp_layer, calls = layer
    h, d, pm = _inputs(megatron_cpu)
    with gdn_compat.applied():
        _forward_backward(mtp_layer, h, d, pm)
    assert [grad for grad, _ in calls] == [False, True]  # forward without grad, then the recompute
    assert all(torch.equal(m, pm) for _, m in calls)


@branch
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_mask_reaches_forward_and_recompute_through_te_checkpoint(layer, megatron_cpu, monkeypatch, recipe):
    import sys

    import megatron.core.extensions.transformer_engine as te_ext
    from megatron.core import tensor_parallel
    from megatron.core.enums import Fp8Recipe

    mtp_layer, calls = layer
    release = sys.modules[type(mtp_layer).__module__]
    seen = []

    def te_checkpoint(function, distribute, rng_tracker, tp_group, *args):  # TE stand-in
        seen.append(("te_checkpoint", outer_active[0]))
        return tensor_parallel.checkpoint(function, distribute, *args)

    outer_active = [False]

    @contextlib.contextmanager
    def fp8_context(config):
        outer_active[0] = True
        yield
        outer_active[0] = False

    monkeypatch.setattr(te_ext, "te_checkpoint", te_checkpoint, raising=False)
    monkeypatch.setattr(release, "get_fp8_context", fp8_context)
    mtp_layer.config.fp8 = "e4m3"
    mtp_layer.config.fp8_recipe = getattr(Fp8Recipe, recipe)
    h, d, pm = _inputs(megatron_cpu)
    with gdn_compat.applied():
        _forward_backward(mtp_layer, h, d, pm)
    assert seen == [("te_checkpoint", recipe == "delayed")]  # outer context only for delayed scaling
    assert [grad for grad, _ in calls] == [False, True]
    assert all(torch.equal(m, pm) for _, m in calls)


@branch
def test_mask_reaches_the_block_fallback(layer, megatron_cpu):
    mtp_layer, calls = layer
    mtp_layer.config.recompute_method = "block"
    h, d, pm = _inputs(megatron_cpu)
    with gdn_compat.applied(), pytest.warns(UserWarning, match="block"):
        _forward_backward(mtp_layer, h, d, pm)
    assert len(calls) == 1 and torch.equal(calls[0][1], pm)


@branch
def test_without_a_mask_the_patch_behaves_like_the_release(layer, megatron_cpu):
    mtp_layer, calls = layer
    original = type(mtp_layer).__dict__["_checkpointed_forward"]
    h, d, _ = _inputs(megatron_cpu, mask=False)
    out0 = original(mtp_layer, hidden_states=h, decoder_input=d, attention_mask=None)
    out0.sum().backward()
    ref = (out0.detach(), h.grad.clone(), d.grad.clone())
    h.grad = d.grad = None
    with gdn_compat.applied():
        got = _forward_backward(mtp_layer, h, d, None)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert [m for _, m in calls] == [None] * 4


@branch
def test_replacement_keeps_the_release_positional_order_and_its_signature_tells_the_truth(layer, megatron_cpu):
    mtp_layer, calls = layer
    cls = type(mtp_layer)
    release = list(inspect.signature(cls.__dict__["_checkpointed_forward"]).parameters.values())
    assert "padding_mask" not in [p.name for p in release]
    h, d, pm = _inputs(megatron_cpu)
    context = torch.randn(6, 2, 8, device=megatron_cpu)
    with gdn_compat.applied():
        params = list(inspect.signature(cls._checkpointed_forward).parameters.values())
        assert params[:-1] == release  # 0.18.x's order, untouched
        assert (params[-1].name, params[-1].kind) == ("padding_mask", inspect.Parameter.KEYWORD_ONLY)
        out = mtp_layer._checkpointed_forward(h, d, None, context, padding_mask=pm)  # 0.18.x positional call
    assert mtp_layer._proj_and_transformer_layer.context is context
    assert torch.equal(calls[0][1], pm) and out.shape == h.shape
