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
