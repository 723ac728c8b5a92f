"""A GatedDeltaNet method replaced the way frameworks replace it is never silently ignored by a packed path (#53).

Frameworks change megatron-core in place (assigning to the release's own class), not only by subclassing, and at any
time. For each way and time (on the release class after ``apply()`` and before it, on a subclass after the layer's
first packed call, on the layer itself), each path that computes a step itself (gdn_compat's default packed path:
gdn_thd on 0.16/0.17, the deterministic route on 0.18/0.19; the fused region) must either honour the replacement,
equal to the release's own code run on every sequence alone (which calls the layer's methods as they are at call
time), or leave the layer to the release's forward, loudly where that forward refuses the call. Through Triton's
interpreter on the CPU, on one release of each GDN generation (0.17.1: gdn_thd; 0.19.2: the native-THD routes).
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

import gdn_compat
from tests.support.fused import interpreted_or_cuda
from tests.support.gdn import clamped_decay, offsets, packed, packed_run, rel, sigmoid_gate
from tests.support.release import FACTS, MEGATRON, skip_reason

FUSED = skip_reason("gdn_fused", gdn_fused=True)
pytestmark = [
    pytest.mark.skipif(FUSED is not None, reason=str(FUSED)),
    pytest.mark.skipif(interpreted_or_cuda() is not None, reason=str(interpreted_or_cuda())),
    pytest.mark.skipif(MEGATRON not in (None, "0.17.1", "0.19.2"),
                       reason=f"one release per GDN generation (0.17.1: gdn_thd, 0.19.2: the routes), not {MEGATRON}"),
    pytest.mark.usefixtures("fresh_fallback_notes"),
]

LENGTHS = [5, 70, 1, 33]  # a chunk edge, a length-1 document
NATIVE = FACTS.gdn_gate_method == "_compute_g_and_beta"  # 0.18/0.19: the steps live in methods of their own


@pytest.fixture
def layer(small_gdn):
    return small_gdn


HONOURED = {"_apply_gated_norm": sigmoid_gate}  # steps the unfused path takes from the layer
if NATIVE:
    HONOURED["_compute_g_and_beta"] = clamped_decay
WAYS = ["release-class-after-apply", "release-class-before-apply", "subclass-after-first-packed-call", "on-the-layer"]
SWITCHES = {"default": {}, "gdn_fused": {"gdn_fused": True}}


def _x(seed: int) -> torch.Tensor:
    return torch.randn(sum(LENGTHS), 1, 64, generator=torch.Generator().manual_seed(seed))


def _dy(x: torch.Tensor) -> torch.Tensor:  # the packed run's output gradient (packed_run's ramp), to slice
    return torch.linspace(-1, 1, x.numel()).reshape(x.shape)


def _per_sequence(layer, x):
    """The release's own forward and backward on every sequence alone, concatenated: the truth."""
    cu, dy = offsets(LENGTHS), _dy(x)
    runs = [packed_run(layer, x[a:b], None, dy[a:b]) for a, b in zip(cu, cu[1:])]
    return torch.cat([r[0] for r in runs]), torch.cat([r[1] for r in runs])


def _subclass(layer) -> None:
    """The layer made an instance of a framework's subclass that does not (yet) override anything."""
    cls = type("FrameworkGDN", (type(layer),), {})
    cls.__module__ = "my_framework.layers"
    layer.__class__ = cls


def _replace(way: str, layer, name: str, fn, monkeypatch) -> None:
    release = type(layer)
    if way.startswith("release-class"):
        monkeypatch.setattr(release, name, fn)
    elif way == "subclass-after-first-packed-call":  # the layer is already of the subclass (_subclass)
        monkeypatch.setattr(release, name, fn, raising=False)
    else:
        monkeypatch.setattr(layer, name, fn.__get__(layer), raising=False)


@pytest.mark.parametrize("switch", sorted(SWITCHES))
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("method", sorted(HONOURED))
def test_a_replaced_step_the_unfused_path_takes_from_the_layer_is_honoured_on_every_path(
        layer, method, way, switch, monkeypatch, caplog):
    x, psp = _x(1), packed(offsets(LENGTHS))
    with caplog.at_level(logging.INFO, logger="gdn_compat"):
        if way == "release-class-before-apply":
            _replace(way, layer, method, HONOURED[method], monkeypatch)
        with gdn_compat.applied(**SWITCHES[switch]):
            if way == "subclass-after-first-packed-call":
                _subclass(layer)
                packed_run(layer, x, psp)  # the layer's class has been seen by the packed path before the change
            if way != "release-class-before-apply":
                _replace(way, layer, method, HONOURED[method], monkeypatch)
            out, dx, _ = packed_run(layer, x, psp)
            want, want_dx = _per_sequence(layer, x)
    assert rel(out, want) < 1e-5 and rel(dx, want_dx) < 1e-5, (rel(out, want), rel(dx, want_dx))
    if switch == "gdn_fused":  # said once, naming the method
        said = [r for r in caplog.records if "gdn_fused not used" in r.getMessage() and method in r.getMessage()]
        assert [r.levelname for r in said] == ["WARNING"], caplog.text


def test_once_the_release_method_is_back_the_fused_region_takes_the_layer_again(layer, monkeypatch, caplog):
    # the check is per call: putting the release's own method back puts the layer back on the fused region
    from gdn_compat.patches.gdn_thd import fast

    x, psp = _x(2), packed(offsets(LENGTHS))
    with gdn_compat.applied(gdn_fused=True):
        fused = packed_run(layer, x, psp)
        with monkeypatch.context() as mp:
            mp.setattr(type(layer), "_apply_gated_norm", sigmoid_gate)
            replaced = packed_run(layer, x, psp)
        fast.forget_notes()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gdn_compat"):
            again = packed_run(layer, x, psp)
    assert rel(replaced[0], fused[0]) > 0.1  # the sigmoid gate took effect
    assert torch.equal(again[0], fused[0]) and torch.equal(again[1], fused[1])
    assert "gdn_fused not used" not in caplog.text, caplog.text


# Steps only the release's forward takes from the layer (0.18/0.19): gdn_compat's packed path leaves the layer to it.
# On the CPU the layer is in deterministic_mode, where the release's forward refuses packed input: a clear error,
# naming the method, instead of the replacement being ignored.

def _prepare_name(layer) -> str:
    return next(n for n in ("_prepare_input_for_gated_delta_rule", "_prepare_qkv_for_gated_delta_rule")
                if hasattr(type(layer), n))


def _scaled_rule(rule):
    def halved(*args, **kwargs):
        out, state = rule(*args, **kwargs)
        return 0.5 * out, state

    return halved


@pytest.mark.skipif(not NATIVE, reason="0.16/0.17 prepare q/k/v inline in the forward gdn_thd replaces")
@pytest.mark.parametrize("switch", sorted(SWITCHES))
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("what", ["prepare", "_gated_norm_and_a2a", "gated_delta_rule"])
def test_a_replaced_step_only_the_release_honours_leaves_the_layer_to_the_release(layer, what, way, switch,
                                                                                    monkeypatch, caplog):
    x, psp = _x(3), packed(offsets(LENGTHS))
    if what == "gated_delta_rule":  # an instance attribute on 0.18/0.19: another kernel
        if way != "on-the-layer":
            pytest.skip("the release sets gated_delta_rule on the layer, in its __init__")
        name, fn = what, None
    else:
        name = _prepare_name(layer) if what == "prepare" else what
        original = getattr(type(layer), name)

        def fn(self, *a, **k):  # a framework's wrapper: the same numbers, another function
            return original(self, *a, **k)

    def replace():
        if fn is None:
            monkeypatch.setattr(layer, name, _scaled_rule(layer.gated_delta_rule))
        else:
            _replace(way, layer, name, fn, monkeypatch)

    with caplog.at_level(logging.INFO, logger="gdn_compat"):
        if way == "release-class-before-apply":
            replace()
        with gdn_compat.applied(**SWITCHES[switch]):
            if way == "subclass-after-first-packed-call":
                _subclass(layer)
                packed_run(layer, x, psp)
            if way != "release-class-before-apply":
                replace()
            with pytest.raises(ValueError, match=f"deterministic_mode.*overrides {name}"):
                packed_run(layer, x, psp)


def test_a_rule_replaced_on_a_0_17_module_is_called_by_the_packed_path(layer, monkeypatch, caplog):
    if NATIVE:
        pytest.skip("0.18/0.19 set the rule on the layer (the test above)")
    # 0.16/0.17 call the module's torch rule in deterministic_mode: a framework's rule there is what runs
    module = sys.modules[type(layer).__module__]
    x, psp = _x(4), packed(offsets(LENGTHS))
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", _scaled_rule(module.torch_chunk_gated_delta_rule))
    for switch in SWITCHES.values():
        with caplog.at_level(logging.INFO, logger="gdn_compat"), gdn_compat.applied(**switch):
            out, dx, _ = packed_run(layer, x, psp)
            want, want_dx = _per_sequence(layer, x)
        assert rel(out, want) < 1e-5 and rel(dx, want_dx) < 1e-5
    assert "overrides gated_delta_rule (the release module: " in caplog.text, caplog.text


def test_judging_a_layer_reads_no_source_per_call(layer, monkeypatch):
    # the verdict is cached per tuple of function identities: the registry's code-object check runs once per function
    from gdn_compat.patches.gdn_thd import kernels, own

    calls = []
    real = own.foreign
    monkeypatch.setattr(own, "foreign", lambda *a: calls.append(a[1]) or real(*a))
    check = own.Own(sys.modules[type(layer).__module__])
    for _ in range(50):
        assert check.replaced(layer, kernels.FUSED_OWN) == ()
    first = len(calls)
    assert first <= len(kernels.FUSED_OWN)
    monkeypatch.setattr(type(layer), "_apply_gated_norm", sigmoid_gate)
    assert [s.split(" ")[0] for s in check.replaced(layer, kernels.FUSED_OWN)] == ["_apply_gated_norm"]
    for _ in range(50):
        check.replaced(layer, kernels.FUSED_OWN)
    assert len(calls) - first <= len(kernels.FUSED_OWN)
