"""gdn_thd on CPU against the release's real GatedDeltaNet (0.16.x/0.17.x; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

import gdn_compat
from gdn_compat.patches import gdn_thd
from tests.support.gdn import build_gdn, l2norm_ref, offsets, packed, packed_run, reference_gdn
from tests.support.release import skip_reason

pytestmark = pytest.mark.skipif(skip_reason("gdn_thd") is not None, reason=str(skip_reason("gdn_thd")))

# a length-1 sequence, lengths that are not multiples of 64, a chunk-sized one, many short ones
LENGTHS = [1, 70, 5, 64, 130, 2, 3, 1, 4, 2, 3, 5, 1, 2]
CU = offsets(LENGTHS)
CFG = dict(dk=16, dv=16, hk=2, hv=4, kernel=4, eps=1e-5)


@pytest.fixture(autouse=True)
def cpu_release_kernels(megatron_cpu, monkeypatch):
    """The release's own (unpacked) forward calls fla's Triton l2norm; give it a torch one on CPU."""
    import megatron.core.ssm.gated_delta_net as mod

    monkeypatch.setattr(mod, "l2norm", l2norm_ref)
    gdn_thd.PACKS.clear()


@pytest.fixture
def patched():
    with gdn_compat.applied(mtp_padding_mask=False) as report:
        assert report["gdn_thd"].status == "applied"
        yield report


def _per_sequence(m, x, spans):
    """The ground truth: the release's own forward, one sequence at a time, same loss weights."""
    T = x.shape[0]
    weight = torch.linspace(-1, 1, T * x.shape[-1]).reshape(T, 1, -1)
    m.zero_grad(set_to_none=True)
    outs, gx = torch.zeros(T, 1, x.shape[-1]), torch.zeros_like(x)
    for a, b in spans:
        xi = x[a:b].detach().clone().requires_grad_(True)
        oi, _ = m(xi, None)
        (oi * weight[a:b]).sum().backward()
        outs[a:b], gx[a:b] = oi.detach(), xi.grad
    return outs, gx, {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def _spans(cu):
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


def test_thd_matches_per_sequence_runs_of_the_release(patched):
    m = build_gdn(deterministic=True)  # the release's CPU path for the per-sequence ground truth
    x = torch.randn(CU[-1], 1, 64)
    out, gx, grads = packed_run(m, x, packed(CU))
    ref_out, ref_gx, ref_grads = _per_sequence(m, x, _spans(CU))
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(gx, ref_gx, rtol=0, atol=1e-6)
    assert set(grads) == set(ref_grads) == {n for n, _ in m.named_parameters()}
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)  # summation order


def test_thd_matches_independent_token_by_token_reference(patched):
    m = build_gdn(deterministic=False)  # CPU tensors take the pure-torch path without deterministic_mode
    cu = CU[:8]
    x = torch.randn(cu[-1], 1, 64)
    out, gx, grads = packed_run(m, x, packed(cu))
    params = {n: p.detach().double().requires_grad_(True) for n, p in m.named_parameters()}
    xr = x[:, 0].double().requires_grad_(True)
    ref = reference_gdn(params, CFG, xr, _spans(cu))
    weight = torch.linspace(-1, 1, ref.numel(), dtype=torch.float64).reshape(ref.shape)
    (ref * weight).sum().backward()
    torch.testing.assert_close(out[:, 0].double(), ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx[:, 0].double(), xr.grad, rtol=1e-4, atol=1e-5)
    for name, p in params.items():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_no_state_leaks_between_packed_sequences(patched):
    m = build_gdn()
    x = torch.randn(CU[-1], 1, 64)
    base, _, _ = packed_run(m, x, packed(CU))
    for j in (0, 1, 4, len(LENGTHS) - 1):  # perturb one sequence at a time
        a, b = CU[j], CU[j + 1]
        y = x.clone()
        y[a:b] += 1.0
        out, _, _ = packed_run(m, y, packed(CU))
        assert not torch.equal(out[a:b], base[a:b])
        keep = torch.ones(CU[-1], dtype=torch.bool)
        keep[a:b] = False
        assert torch.equal(out[keep], base[keep]), f"perturbing sequence {j} changed other sequences"


def test_padded_cu_seqlens_define_the_sequences(patched):
    m = build_gdn(deterministic=True)
    actual, padded = [0, 5, 12, 13], [0, 8, 16, 24]  # alignment padding (e.g. for FP8) inside the pack
    x = torch.randn(padded[-1], 1, 64)
    out, gx, _ = packed_run(m, x, packed(actual, padded=padded))
    ref_out, ref_gx, _ = _per_sequence(m, x, _spans(padded))
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(gx, ref_gx, rtol=0, atol=1e-6)


def test_gqa_with_four_value_heads_per_key_head(patched):
    cfg = dict(CFG, hk=1, hv=4)
    m = build_gdn(hk=1, hv=4)
    cu = [0, 3, 40, 41]
    x = torch.randn(cu[-1], 1, 64)
    out, _, _ = packed_run(m, x, packed(cu))
    ref = reference_gdn(dict(m.named_parameters()), cfg, x[:, 0], _spans(cu))
    torch.testing.assert_close(out[:, 0].double(), ref.detach(), rtol=1e-4, atol=1e-5)


def test_zero_length_sequences_are_dropped_exactly(patched):
    m = build_gdn()
    x = torch.randn(20, 1, 64)
    with_empty, _, _ = packed_run(m, x, packed([0, 0, 7, 7, 7, 20, 20]))
    without, _, _ = packed_run(m, x, packed([0, 7, 20]))
    assert torch.equal(with_empty, without)


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", None])
def test_unpacked_formats_run_the_release_code_bitwise(patched, fmt):
    m = build_gdn(deterministic=True)
    x = torch.randn(12, 2, 64)
    ref, _ = m(x, None, packed_seq_params=None)
    out, _ = m(x, None, packed_seq_params=packed([0, 12], fmt=fmt))
    assert torch.equal(out, ref)


def test_fla_without_varlen_kernels_is_skipped_at_apply_with_the_reason(monkeypatch):
    import dataclasses

    from gdn_compat._probe import Accepts

    real = gdn_compat.probe()
    no_varlen = dataclasses.replace(real, fla_varlen=dataclasses.replace(real.fla_varlen, rule=Accepts.NO))
    monkeypatch.setattr(gdn_compat, "probe", lambda **kw: no_varlen)
    with gdn_compat.applied() as report:
        assert report["gdn_thd"].status == "skipped"
        assert "chunk_gated_delta_rule cu_seqlens=no" in report["gdn_thd"].reason
        assert report["config_gdn_cp"].status == "skipped"  # its CP would come from gdn_thd


def test_unpatched_release_refuses_and_revert_restores_it(megatron_cpu):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    original = GatedDeltaNet.__dict__["forward"]
    m = build_gdn()
    x = torch.randn(12, 1, 64)
    with pytest.raises(NotImplementedError):
        m(x, None, packed_seq_params=packed([0, 12], fmt="bshd"))
    with gdn_compat.applied():
        assert GatedDeltaNet.__dict__["forward"] is not original
        assert GatedDeltaNet.forward.__wrapped__ is original
        m(x, None, packed_seq_params=packed([0, 5, 12]))
    assert GatedDeltaNet.__dict__["forward"] is original
    with pytest.raises(NotImplementedError, match="packed sequence"):
        m(x, None, packed_seq_params=packed([0, 5, 12]))


# -- bad input: each a clear error naming the values ----------------------------------------


def test_batch_other_than_one_is_refused(patched):
    with pytest.raises(ValueError, match="batch 2"):
        build_gdn()(torch.randn(6, 2, 64), None, packed_seq_params=packed([0, 6]))


def test_last_offset_must_equal_token_count(patched):
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]=10 does not match .* 12"):
        build_gdn()(torch.randn(12, 1, 64), None, packed_seq_params=packed([0, 4, 10]))


def test_q_and_kv_offsets_must_agree(patched):
    psp = packed([0, 4, 12], kv=torch.tensor([0, 6, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, 4, 12\] and cu_seqlens_kv=\[0, 6, 12\] differ"):
        build_gdn()(torch.randn(12, 1, 64), None, packed_seq_params=psp)


def test_offsets_must_be_non_decreasing(patched):
    with pytest.raises(ValueError, match=r"non-decreasing, got \[0, 8, 4, 12\]"):
        build_gdn()(torch.randn(12, 1, 64), None, packed_seq_params=packed([0, 8, 4, 12]))


@pytest.mark.parametrize("bad", [torch.tensor([0.0, 12.0]), torch.tensor([0, 12], dtype=torch.int16)])
def test_offsets_must_be_int32_or_int64(patched, bad):
    psp = packed([0, 12])
    psp.cu_seqlens_q = psp.cu_seqlens_kv = bad
    with pytest.raises(TypeError, match=str(bad.dtype)):
        build_gdn()(torch.randn(12, 1, 64), None, packed_seq_params=psp)


def test_offsets_on_another_device_are_refused(patched):
    psp = packed([0, 12])
    psp.cu_seqlens_q = psp.cu_seqlens_kv = torch.empty(2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="is on meta but hidden_states are on cpu"):
        build_gdn()(torch.randn(12, 1, 64), None, packed_seq_params=psp)


def test_in_place_change_of_offsets_is_not_served_from_cache(patched):
    m = build_gdn()
    psp = packed([0, 4, 12])
    x = torch.randn(12, 1, 64)
    m(x, None, packed_seq_params=psp)
    psp.cu_seqlens_q[1] = 20  # same tensor object, new (wrong) values
    with pytest.raises(ValueError, match="non-decreasing"):
        m(x, None, packed_seq_params=psp)


def test_inference_context_with_thd_is_refused(patched):
    with pytest.raises(NotImplementedError, match="inference context"):
        build_gdn()(torch.randn(12, 1, 64), None, inference_context=object(), packed_seq_params=packed([0, 12]))


def test_a_second_head_count_keeps_the_compiled_input_step_static_in_its_heads():
    """The CUDA core's input step runs through megatron's jit_fuser (torch.compile, as in the release). One compiled
    copy per layer shape (#37): a second head count in the process must not recompile a shared copy with its head
    sizes symbolic (on the H200 those kernels were ~8x slower); only the pack length may go dynamic."""
    import logging

    from gdn_compat.patches.gdn_thd import kernels

    class Symbols(logging.Handler):
        def __init__(self):
            super().__init__()
            self.made: list[str] = []

        def emit(self, record):
            if record.getMessage().startswith("create_symbol"):
                self.made.append(record.getMessage().split(" [")[0])

    def call(tokens: int, hk: int, hv: int, d: int = 8):
        shape = (hk * d, hv * d, d, d, hv // hk)
        prepare, _ = kernels._fused(shape)
        qkv = torch.randn(1, tokens, (2 * hk + hv) * d)
        gate, beta, alpha = torch.randn(1, tokens, hv, d), torch.randn(1, tokens, hv), torch.randn(1, tokens, hv)
        out = prepare(qkv, gate, beta, alpha, tokens, *shape, True, kernels.l2norm_torch)
        want_k = kernels.l2norm_torch(qkv[..., hk * d:2 * hk * d].reshape(1, tokens, hk, d))
        torch.testing.assert_close(out[1], want_k.repeat_interleave(hv // hk, dim=2))  # and it computes the step

    symbols, logger = Symbols(), logging.getLogger("torch.fx.experimental.symbolic_shapes")
    logger.addHandler(symbols)
    torch._logging.set_logs(dynamic=logging.INFO)
    # compiled, as users run it (the CPU stand-ins turn dynamo off); torch's own patch, which restores the setting
    # (pytest's monkeypatch deletes a torch config entry it did not find in the module's __dict__ on undo)
    try:
        with torch._dynamo.config.patch(disable=False):
            torch._dynamo.reset()
            call(64, 2, 4)
            call(32, 1, 2)  # another layer shape
            call(48, 1, 2)  # that shape with another pack length
    finally:
        torch._logging.set_logs()
        logger.removeHandler(symbols)
        torch._dynamo.reset()
    assert symbols.made, "no recompile was observed: the check saw nothing"
    heads = [s for s in symbols.made if not ("L['seq_len']" in s or ".size()[1]" in s)]
    assert not heads, f"symbolic sizes other than the pack length: {heads}"
