"""gdn_compat's fused Triton kernels against a plain-torch reference of the same math, forward and backward.

On a machine without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py
before anything imports Triton). Packs have a length-1 sequence, lengths across the kernels' token blocks
(16/32) and fla's chunks (64), and zero-length entries at the start, middle and end; the reference
(``gdn_compat.fused.reference``) is written from the formulas, per sequence, in fp64.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.fused import CU, DIMS, gradients, inputs, interpreted_or_cuda, ref_core, region_inputs, token_bounds

pytestmark = [pytest.mark.skipif(interpreted_or_cuda() is not None, reason=str(interpreted_or_cuda())),
              pytest.mark.interpreted_kernels]  # in the interpreter: 0.19.2 and triton_compile(3.7.0) (tests/conftest.py)

from gdn_compat.fused import conv, gate, norm, reference  # noqa: E402  (after the skip: needs Triton)
from gdn_compat.fused.region import Spec, region  # noqa: E402


@pytest.mark.parametrize("tokens_per_program", [conv.TOKENS_PER_PROGRAM, 64], ids=["default", "ranges-of-64"])
@pytest.mark.parametrize("norm_qk,bias", [(True, True), (False, False)])
def test_conv_forward_and_backward_match_per_sequence_torch(norm_qk, bias, tokens_per_program, monkeypatch):
    # ranges of 64 tokens (2 blocks of 32): sequences cross the backward's ranges, whose last rows need the
    # next range's da, and each program takes several (range, head) items
    monkeypatch.setattr(conv, "TOKENS_PER_PROGRAM", tokens_per_program)
    x, w, b = inputs(channels=48, width=4, bias=bias)
    starts, ends = token_bounds(CU, x.shape[0])
    heads, d = 3, 16
    out = torch.empty(x.shape[0], heads * 2, d)  # repeated twice, as for a core without GVA
    conv.conv_fwd(x, w, b, starts, out, 0, heads, d, 2, norm_qk, 1e-6)

    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    br = None if b is None else b.double().requires_grad_(True)
    ref = reference.conv_act(xr, wr, br, CU)[:, :48].reshape(-1, heads, d)
    if norm_qk:
        ref = reference.l2norm(ref)
    ref = ref.repeat_interleave(2, 1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)

    dout = torch.randn_like(out)
    ref.backward(dout.double())
    dx = torch.full_like(x, float("nan"))  # the kernel must write every row of its columns
    parts = conv.partials(x.shape[0])
    dw, db = torch.empty(parts, *w.shape), torch.empty(parts, w.shape[0])
    conv.conv_bwd(x, w, b, starts, ends, dout, dx, dw, db, 0, heads, d, 2, norm_qk, 1e-6)
    torch.testing.assert_close(dx.double(), xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.sum(0).double(), wr.grad, rtol=1e-5, atol=1e-5)
    if b is not None:
        torch.testing.assert_close(db.sum(0).double(), br.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens_per_program", [conv.TOKENS_PER_PROGRAM, 64], ids=["default", "ranges-of-64"])
@pytest.mark.parametrize("d,width,norm_qk", [(16, 1, False), (16, 2, False), (16, 8, False), (128, 4, True),
                                             (128, 4, False)])
def test_conv_backward_matches_per_sequence_torch_at_every_width_and_launch_shape(d, width, norm_qk,
                                                                                   tokens_per_program, monkeypatch):
    # widths 1..8 (one weight-gradient accumulator per tap, not only the models' 4); head dims >= 128 take the
    # launch shape of conv.BWD_ROWS (measured on the H200), whose blocks are shorter than the sequences; with
    # ranges of 64 tokens sequences cross the backward's ranges
    monkeypatch.setattr(conv, "TOKENS_PER_PROGRAM", tokens_per_program)
    x, w, b = inputs(channels=d, width=width, bias=True)
    starts, ends = token_bounds(CU, x.shape[0])
    xr, wr, br = (t.double().requires_grad_(True) for t in (x, w, b))
    ref = reference.conv_act(xr, wr, br, CU).reshape(-1, 1, d)
    if norm_qk:
        ref = reference.l2norm(ref)
    dout = torch.randn_like(ref, dtype=x.dtype)
    ref.backward(dout.double())
    dx = torch.full_like(x, float("nan"))
    parts = conv.partials(x.shape[0])
    dw, db = torch.empty(parts, *w.shape), torch.empty(parts, w.shape[0])
    conv.conv_bwd(x, w, b, starts, ends, dout, dx, dw, db, 0, 1, d, 1, norm_qk, 1e-6)
    torch.testing.assert_close(dx.double(), xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.sum(0).double(), wr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db.sum(0).double(), br.grad, rtol=1e-5, atol=1e-5)


def test_conv_never_reads_across_a_sequence_boundary():
    x, w, b = inputs(channels=16, width=4, bias=True)
    starts, ends = token_bounds(CU, x.shape[0])
    base = torch.empty(x.shape[0], 1, 16)
    conv.conv_fwd(x, w, b, starts, base, 0, 1, 16, 1, True, 1e-6)
    spans = reference.spans(CU)
    for a, e in (spans[0], spans[len(spans) // 2], spans[-1]):
        y = x.clone()
        y[a:e] += 3.0
        out = torch.empty_like(base)
        conv.conv_fwd(y, w, b, starts, out, 0, 1, 16, 1, True, 1e-6)
        keep = torch.ones(x.shape[0], dtype=torch.bool)
        keep[a:e] = False
        assert torch.equal(out[keep], base[keep]), f"tokens outside [{a}, {e}) changed"
        assert not torch.equal(out[a:e], base[a:e])


def test_gate_forward_and_backward_match_the_formula():
    torch.manual_seed(3)
    T, H = 150, 6
    x = torch.randn(T, 2 * H + 5) * 4  # a wide range: softplus's large-input branch is taken too
    a_log, dt = torch.randn(H), torch.randn(H)
    g, beta = gate.gate_fwd(x, a_log, dt, a_col=H + 5, b_col=5, heads=H)
    ar, br = x[:, H + 5:].double().requires_grad_(True), x[:, 5:H + 5].double().requires_grad_(True)
    la, dr = a_log.double().requires_grad_(True), dt.double().requires_grad_(True)
    g_ref, beta_ref = reference.gate(ar, br, la, dr)
    torch.testing.assert_close(g.double(), g_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(beta.double(), beta_ref, rtol=1e-6, atol=1e-6)
    dg, dbeta = torch.randn(T, H), torch.randn(T, H)
    dx = torch.full_like(x, float("nan"))
    da_log, ddt = gate.gate_bwd(x, a_log, dt, dg, dbeta, dx, a_col=H + 5, b_col=5, heads=H)
    (g_ref * dg.double()).sum().add((beta_ref * dbeta.double()).sum()).backward()
    torch.testing.assert_close(dx[:, H + 5:].double(), ar.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx[:, 5:H + 5].double(), br.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(da_log.double(), la.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ddt.double(), dr.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dz_pass", ["same", "second"])
@pytest.mark.parametrize("zc", [0.0, 1.0])
def test_gated_norm_forward_and_backward_match_the_formula(zc, dz_pass):
    torch.manual_seed(4)
    T, H, D = 70, 3, 16
    o = torch.randn(T, H, D)
    x = torch.randn(T, 9 + H * D + 2)  # z sits at column 9 of a wider row
    w = torch.randn(D)
    y = norm.norm_fwd(o, x, w, z_col=9, eps=1e-5, zc=zc)
    orf, zr = o.double().requires_grad_(True), x[:, 9:9 + H * D].double().reshape(T, H, D).requires_grad_(True)
    wr = w.double().requires_grad_(True)
    ref = reference.gated_norm(orf, zr, wr, 1e-5, zc).reshape(T, H * D)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    dy = torch.randn_like(y)
    dx = torch.full_like(x, float("nan"))
    if dz_pass == "same":  # dz into x's z columns of dx, from the pass that computes do
        do, dw = norm.norm_bwd(dy, o, x, w, z_col=9, eps=1e-5, zc=zc, dz=dx[:, 9:9 + H * D])
    else:
        do, dw = norm.norm_bwd(dy, o, x, w, z_col=9, eps=1e-5, zc=zc)
        assert dx.isnan().all()  # no dz yet
        norm.norm_dz(dy, o, x, w, dx[:, 9:9 + H * D], z_col=9, eps=1e-5, zc=zc)
    ref.backward(dy.double())
    torch.testing.assert_close(do.double(), orf.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx[:, 9:9 + H * D].double(), zr.grad.reshape(T, H * D), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw.double(), wr.grad, rtol=1e-5, atol=1e-5)
    assert dx[:, :9].isnan().all() and dx[:, 9 + H * D:].isnan().all()  # no column outside z written


@pytest.mark.parametrize("lean", [False, True], ids=["dx-after-core", "dx-before-core"])
def test_region_forward_and_every_gradient_match_the_torch_reference(lean):
    x, params = region_inputs()
    core = ref_core(CU)
    core.lean_backward = lean  # dz in a second pass after the core's backward, or in the norm's one pass
    spec = Spec(**DIMS, l2norm=True, norm_eps=1e-5, zero_centered=False, core=core)
    y, grads = gradients(lambda *a: region(*a, token_bounds(CU, x.shape[0]), spec), x, params)
    y_ref, grads_ref = gradients(
        lambda xx, cw, cb, al, dt, nw: reference.region(xx, cw, cb, al, dt, nw, CU, **DIMS),
        x.double(), {k: v.double() for k, v in params.items()})
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad.double(), grads_ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_region_backward_is_bitwise_repeatable():
    x, params = region_inputs()
    spec = Spec(**DIMS, l2norm=True, norm_eps=1e-5, zero_centered=False, core=ref_core(CU))
    runs = [gradients(lambda *a: region(*a, token_bounds(CU, x.shape[0]), spec), x, params) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0])
    for name in runs[0][1]:
        assert torch.equal(runs[0][1][name], runs[1][1][name]), name


def test_region_refuses_a_row_layout_it_cannot_read():
    x, params = region_inputs()
    spec = Spec(**DIMS, l2norm=True, norm_eps=1e-5, zero_centered=False, core=ref_core(CU))
    with pytest.raises(ValueError, match=r"must be \[tokens, \d+\]"):
        region(x[:, :-1], *params.values(), token_bounds(CU, x.shape[0]), spec)
