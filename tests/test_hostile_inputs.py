"""Hostile inputs to gdn_compat's packed paths on every release with GDN (#41), through Triton's interpreter on the CPU.

The four holes an adversarial pass found, each shown failing before its fix, and inputs that held, kept held:

1. a pack made under ``torch.inference_mode()`` (RL reference log-probs) must never reach a later training step;
2. an out_norm with ``eps=None`` (torch's RMSNorm default) is resolved as the module itself resolves it;
3. a GatedDeltaNet subclass that overrides a method a path computes itself is not taken by that path;
4. a gradient of a gradient through a gdn_compat autograd Function is an error naming gdn_compat, not a silently
   partial result.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import gdn_compat
from gdn_compat.patches.gdn_thd import PACKS
from gdn_compat.patches.gdn_thd.fast import norm_eps
from tests.support.fused import interpreted_or_cuda
from tests.support.gdn import clamped_decay, offsets, packed, packed_run, rel, sigmoid_gate
from tests.support.release import FACTS, MEGATRON, skip_reason

FUSED = skip_reason("gdn_fused", gdn_fused=True)
pytestmark = [
    pytest.mark.skipif(FUSED is not None, reason=str(FUSED)),
    pytest.mark.skipif(interpreted_or_cuda() is not None, reason=str(interpreted_or_cuda())),
    pytest.mark.usefixtures("fresh_fallback_notes"),
    pytest.mark.heavy,  # about 100 s in Triton's interpreter: once per distinct megatron-core source
    # gdn_compat's packed paths are one code per generation (gdn_thd on 0.16/0.17, the routes on 0.18/0.19): the last
    # release of each runs them, which keeps the suite's time
    pytest.mark.skipif(MEGATRON not in (None, "0.16.1", "0.17.1", "0.18.2", "0.19.2"),
                       reason=f"hostile inputs run on the last release of each generation, not {MEGATRON}"),
]

LENGTHS = [3, 0, 70, 1, 0]  # a zero-length entry inside and at the end, a chunk edge, a length-1 document
# the cases that run gdn_fused's kernels (in Triton's interpreter on the CPU: 0.17.1 and 0.19.2, tests/conftest.py)
kernels = pytest.mark.interpreted_fused


@pytest.fixture
def layer(small_gdn):
    return small_gdn


def _x(seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(sum(LENGTHS), 1, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)


# 1. inference mode -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("switches, same_object, cu", [
    ({}, True, offsets(LENGTHS)),
    pytest.param({"gdn_fused": True}, True, offsets(LENGTHS), marks=kernels),
    pytest.param({"gdn_fused": True}, False, offsets([3, 70, 1]), marks=kernels),
], ids=["default-same-params-empty-entries", "gdn_fused-same-params-empty-entries", "gdn_fused-new-params-no-empties"])
def test_a_pack_made_under_inference_mode_never_reaches_a_training_step(layer, switches, same_object, cu):
    x = _x(1)[: cu[-1]]
    psp = packed(cu)
    with gdn_compat.applied(**switches):
        want = packed_run(layer, x, packed(cu))  # a training step on its own
        PACKS.clear()
        with torch.inference_mode():  # an evaluation pass first, on the same offsets
            evaluated = layer(x, None, packed_seq_params=psp)[0]
        for _ in range(2):  # then training steps: every later step too
            got = packed_run(layer, x, psp if same_object else packed(cu))
    assert torch.equal(evaluated, want[0])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])


@kernels
def test_an_evaluation_under_inference_mode_after_training_gets_inference_free_results(layer):
    x, psp = _x(2), packed(offsets(LENGTHS))
    with gdn_compat.applied(gdn_fused=True):
        want = packed_run(layer, x, psp)[0]
        with torch.inference_mode():
            got = layer(x, None, packed_seq_params=psp)[0]
        again = packed_run(layer, x, psp)[0]  # the pack the evaluation saw is still a training pack
    assert torch.equal(got, want) and torch.equal(again, want)


# 2. eps=None -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_eps_none_resolves_as_torch_rmsnorm_does_for_the_input_dtype(dtype):
    norm = torch.nn.RMSNorm(16, dtype=dtype)  # eps=None, torch's default
    x = (1e-2 * torch.randn(8, 16, generator=torch.Generator().manual_seed(3))).to(dtype)  # eps matters here
    want = norm(x).double()
    ours = F.rms_norm(x.double(), (16,), norm.weight.double(), norm_eps(None, dtype))
    naive = F.rms_norm(x.double(), (16,), norm.weight.double(), torch.finfo(dtype).eps)  # the input dtype's eps
    tolerance = 2 * torch.finfo(dtype).eps
    assert (ours - want).abs().max() <= tolerance * want.abs().max()
    if dtype in (torch.bfloat16, torch.float16):  # where the two readings differ, the naive one is far off
        assert (naive - want).abs().max() > 10 * tolerance * want.abs().max()
    assert norm_eps(1e-5, dtype) == 1e-5


@kernels
def test_the_fused_norm_takes_an_out_norm_with_eps_none_as_the_module_computes_it(layer):
    layer.to(torch.bfloat16)
    norm = torch.nn.RMSNorm(layer.value_head_dim, dtype=torch.bfloat16)  # eps=None
    with torch.no_grad():
        norm.weight.copy_(layer.out_norm.weight)
    layer.out_norm = norm
    x = 0.05 * _x(4, torch.bfloat16)  # a small input: the core's outputs are small, so eps matters
    with gdn_compat.applied():
        unfused = packed_run(layer, x, packed(offsets(LENGTHS)))
    with gdn_compat.applied(gdn_fused=True):
        fused = packed_run(layer, x, packed(offsets(LENGTHS)))
    assert rel(fused[0], unfused[0]) < 2e-2 and rel(fused[1], unfused[1]) < 2e-2  # bf16 steps apart, not 0.96
    assert rel(fused[2]["out_norm.weight"], unfused[2]["out_norm.weight"]) < 2e-2


# 3. subclasses -----------------------------------------------------------------------------------------------------


def _subclass(layer, **methods):
    cls = type("FrameworkGDN", (type(layer),), methods)
    cls.__module__ = "my_framework.layers"
    layer.__class__ = cls
    return layer


SUBCLASSES = {"_apply_gated_norm": sigmoid_gate}
if FACTS.gdn_gate_method == "_compute_g_and_beta":  # 0.18/0.19 compute the gate in a method of its own
    SUBCLASSES["_compute_g_and_beta"] = clamped_decay


@pytest.mark.parametrize("method", sorted(SUBCLASSES))
def test_gdn_fused_leaves_a_subclass_that_overrides_a_method_it_computes_to_the_path_that_honours_it(
        layer, method, caplog):
    layer = _subclass(layer, **{method: SUBCLASSES[method]})
    x, psp = _x(5), packed(offsets(LENGTHS))
    cu = offsets(LENGTHS)
    singles = [packed_run(layer, x[a:b], None) for a, b in zip(cu, cu[1:]) if b > a]  # the release's own, honouring it
    with gdn_compat.applied():
        unfused = packed_run(layer, x, psp)
    with caplog.at_level(logging.INFO, logger="gdn_compat"), gdn_compat.applied(gdn_fused=True):
        fused = packed_run(layer, x, psp)
    assert rel(unfused[0], torch.cat([s[0] for s in singles])) < 1e-5  # the unfused path honours the override
    assert torch.equal(fused[0], unfused[0]) and torch.equal(fused[1], unfused[1])
    said = [r for r in caplog.records if "gdn_fused not used" in r.getMessage() and method in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"], caplog.text


@pytest.mark.skipif(FACTS.gdn_gate_method == "", reason="0.16/0.17 prepare q/k/v inline in the forward gdn_thd replaces")
def test_a_route_leaves_a_subclass_that_overrides_what_it_computes_to_the_release(layer, caplog):
    # 0.18/0.19: gdn_compat's packed path prepares q/k/v itself; a layer that overrides that step keeps the release's
    # forward; in deterministic_mode, which that forward refuses for THD, a clear error names the override instead
    name = next(n for n in ("_prepare_input_for_gated_delta_rule", "_prepare_qkv_for_gated_delta_rule")
                if hasattr(type(layer), n))
    original = getattr(type(layer), name)
    layer = _subclass(layer, **{name: lambda self, *a, **k: original(self, *a, **k)})
    with caplog.at_level(logging.INFO, logger="gdn_compat"), gdn_compat.applied(gdn_fused=True):
        with pytest.raises(ValueError, match=f"deterministic_mode.*FrameworkGDN overrides {name}"):
            packed_run(layer, _x(6), packed(offsets(LENGTHS)))
    # the gdn_fused route above the deterministic one said it leaves the layer to what is underneath
    assert f"overrides {name}" in caplog.text and "; the release's own forward runs that layer" in caplog.text


# 4. double backward ------------------------------------------------------------------------------------------------


@kernels
def test_a_gradient_penalty_through_the_fused_region_is_an_error_naming_gdn_compat(layer):
    x = _x(7).requires_grad_(True)
    with gdn_compat.applied(gdn_fused=True):
        out = layer(x, None, packed_seq_params=packed(offsets(LENGTHS)))[0]
        (dx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="gdn_compat: the fused GDN region"):
            dx.square().sum().backward()


@kernels
def test_a_first_order_backward_with_create_graph_still_gives_the_plain_gradients(layer):
    x = _x(8)
    with gdn_compat.applied(gdn_fused=True):
        want = packed_run(layer, x, packed(offsets(LENGTHS)))
        leaf = x.clone().requires_grad_(True)
        out = layer(leaf, None, packed_seq_params=packed(offsets(LENGTHS)))[0]
        dy = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
        (dx,) = torch.autograd.grad(out, leaf, dy, create_graph=True)
    assert torch.equal(dx, want[1])


# inputs that held: kept held --------------------------------------------------------------------------------------


@kernels
@pytest.mark.parametrize("case", ["int64-offsets", "non-contiguous-input", "no-grad", "padded-pack"])
def test_inputs_that_held_still_equal_the_unfused_path(layer, case):
    cu = offsets(LENGTHS)
    x, psp = _x(9), packed(cu)
    if case == "int64-offsets":
        psp.cu_seqlens_q = psp.cu_seqlens_kv = torch.tensor(cu, dtype=torch.int64)
    if case == "non-contiguous-input":
        x = torch.randn(64, 1, x.shape[0], generator=torch.Generator().manual_seed(9)).transpose(0, 2)
    if case == "padded-pack":
        slots = [4, 0, 72, 4, 0]
        x = torch.randn(sum(slots), 1, 64, generator=torch.Generator().manual_seed(9))
        psp = packed(cu, padded=offsets(slots))
    runs = []
    for switches in ({}, {"gdn_fused": True}):
        with gdn_compat.applied(**switches):
            if case == "no-grad":
                with torch.no_grad():
                    runs.append((layer(x, None, packed_seq_params=psp)[0],))
            else:
                runs.append(packed_run(layer, x, psp))
    assert rel(runs[1][0], runs[0][0]) < 1e-5
    if case != "no-grad":
        assert rel(runs[1][1], runs[0][1]) < 1e-5
        assert all(rel(runs[1][2][n], runs[0][2][n]) < 1e-4 for n in runs[0][2])
