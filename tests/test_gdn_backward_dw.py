"""gdn_backward_dw (#22 item 2): 0.16.x GatedDeltaNet gets the backward_dw that MoE expert-parallel overlap calls.

Through the release's own ``TransformerLayer.init_backward_dw_wrapper`` (``_BackwardDWWrapper``, built for
every layer when ``overlap_moe_expert_parallel_comm`` is on) on a real GDN TransformerLayer.
"""

from __future__ import annotations

import pytest
import torch

import gdn_compat
from tests.support import model as M
from tests.support.gdn import use_torch_l2norm
from tests.support.release import FACTS, skip_reason

pytestmark = pytest.mark.skipif(skip_reason("gdn_backward_dw") is not None, reason=str(skip_reason("gdn_backward_dw")))


@pytest.fixture
def layer(megatron_cpu, monkeypatch):
    from megatron.core.transformer.spec_utils import build_module

    use_torch_l2norm(monkeypatch)
    cfg = M.config(layers=1, deterministic=True)  # the release's unpacked GDN runs on the CPU so
    torch.manual_seed(0)
    return build_module(M.block_spec(cfg).layer_specs[0], config=cfg, layer_number=1)


def _step(layer) -> dict[str, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x = torch.randn(12, 1, M.SHAPE["hidden"], generator=torch.Generator().manual_seed(1))
    out = layer(x, attention_mask=None)
    (out[0] if isinstance(out, tuple) else out).square().sum().backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def test_unpatched_release_cannot_build_the_ep_overlap_wrapper(layer):
    assert FACTS.gdn_backward_dw == "no"
    with pytest.raises(AttributeError, match="'GatedDeltaNet' object has no attribute 'backward_dw'"):
        layer.init_backward_dw_wrapper()


def test_patched_layer_runs_the_release_wrapper_and_local_linears_keep_their_gradients(layer):
    with gdn_compat.applied() as report:
        assert report["gdn_backward_dw"].status == "applied"
        layer.init_backward_dw_wrapper()
        grads = _step(layer)
        layer.backward_dw_wrapper.backward_dw()  # what the EP-overlap schedule calls after backward
        after = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    assert grads and all(torch.equal(grads[n], after[n]) for n in grads)  # local linears delay nothing
    assert not hasattr(type(layer.self_attention), "backward_dw")  # reverted: the release's class again


def test_a_linear_that_delays_its_weight_gradient_gets_it_in_order(layer, monkeypatch):
    calls = []
    for name in ("in_proj", "out_proj"):
        linear = getattr(layer.self_attention, name)

        def delayed(linear=linear, name=name):  # as Transformer Engine's linears do with delay_wgrad_compute
            calls.append(name)
            linear.weight.grad = torch.full_like(linear.weight, len(calls))

        monkeypatch.setattr(linear, "backward_dw", delayed, raising=False)
    with gdn_compat.applied():
        layer.init_backward_dw_wrapper()
        layer.backward_dw_wrapper.backward_dw()
    assert calls == ["in_proj", "out_proj"]  # 0.17's order
    assert layer.self_attention.in_proj.weight.grad.eq(1).all() and layer.self_attention.out_proj.weight.grad.eq(2).all()


def test_an_unknown_linear_without_backward_dw_is_an_error_naming_it(layer, monkeypatch):
    monkeypatch.setattr(layer.self_attention, "out_proj", torch.nn.Linear(4, 4))
    with gdn_compat.applied():
        with pytest.raises(AttributeError, match="GatedDeltaNet.out_proj is a Linear without backward_dw"):
            layer.self_attention.backward_dw()


def test_a_backward_dw_from_elsewhere_in_a_subclass_mro_keeps_precedence(layer):
    gdn = type(layer.self_attention)
    calls = []

    class Mixin:
        def backward_dw(self):
            calls.append("mixin")

    class MyGDN(gdn, Mixin):
        pass

    mine = MyGDN.__new__(MyGDN)  # no constructor needed to resolve a method
    with gdn_compat.applied() as report:
        assert report["gdn_backward_dw"].status == "applied"
        mine.backward_dw()
        assert calls == ["mixin"]  # not the added method, which would raise on this bare object
        assert MyGDN.backward_dw is Mixin.__dict__["backward_dw"]
        assert gdn.backward_dw.__name__ == "backward_dw" and gdn.backward_dw.__module__ == "gdn_compat.patches.gdn_backward_dw"


def test_a_backward_dw_that_is_not_the_release_own_is_not_credited_to_upstream():
    import dataclasses

    from gdn_compat._probe import Accepts
    from gdn_compat.patches import gdn_backward_dw

    own = dataclasses.replace(FACTS, gdn_backward_dw=Accepts.YES, notes={"gdn_backward_dw": "the release's own, defined by GatedDeltaNet in x"})
    other = dataclasses.replace(FACTS, gdn_backward_dw=Accepts.YES,
                                notes={"gdn_backward_dw": "not the release's: defined by mylib.Base (mylib.Base.backward_dw)"})
    assert "#2997" in gdn_backward_dw.decide(own)
    reason = gdn_backward_dw.decide(other)
    assert "#2997" not in reason and "mylib.Base" in reason


def test_reverting_after_someone_replaced_the_added_method_says_nothing_of_ours_is_underneath(layer):
    gdn = type(layer.self_attention)
    gdn_compat.apply()
    try:
        def theirs(self):
            return None

        gdn.backward_dw = theirs
        [rec] = [r for r in gdn_compat.revert() if r.name == "gdn_backward_dw"]
        assert rec.status == "left_in_place"
        assert "stays underneath" not in rec.reason and "is no longer there" in rec.reason
    finally:
        if "backward_dw" in gdn.__dict__:
            del gdn.backward_dw
        gdn_compat.revert()
