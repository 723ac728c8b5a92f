"""GDN THD on an H200, bf16, fla kernels: the shim on 0.16/0.17, upstream's native path on 0.18+.

Run once per release (../shared/gpu/device-run.sh). 0.16/0.17 save weights, inputs and results to
$GDN_XVER_DIR; the native 0.18/0.19 runs load them and must reproduce them bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

import gdn_compat
from gdn_compat.patches import gdn_thd
from tests.support.gdn import QWEN3_NEXT, build_gdn, host_syncs, offsets, packed, packed_run, rel
from tests.support.release import FACTS, MEGATRON

CU = offsets([1, 70, 300, 64, 129, 5, 431])  # 1000 tokens
SHAPE = QWEN3_NEXT  # as the benchmark: kernels compiled and autotuned once
XVER = os.environ.get("GDN_XVER_DIR")  # a directory the per-release runs of one session share
NATIVE = FACTS.gdn_thd == "native"


@pytest.fixture(scope="module")
def thd_ready(megatron_cpu):
    assert megatron_cpu == "cuda"
    if FACTS.gdn == "absent":
        pytest.skip(f"megatron-core {MEGATRON} has no GatedDeltaNet")
    report = gdn_compat.apply()
    assert NATIVE or report["gdn_thd"].status == "applied", report["gdn_thd"]
    yield
    gdn_compat.revert()


def fwd_bwd(m, x, cu_list, seed=0):
    gdn_thd.PACKS.clear()
    psp = packed(cu_list)
    psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    dy = torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=gen)  # GDN output has x's shape
    return (*packed_run(m, x, psp, dy), dy)


def per_sequence(m, x, dy):
    """Ground truth: every sequence alone (a one-sequence pack), gradients accumulated."""
    m.zero_grad(set_to_none=True)
    outs, gxs = [], []
    for a, b in zip(CU, CU[1:]):
        xi = x[a:b].detach().clone().requires_grad_(True)
        psp = packed([0, b - a])
        psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
        oi, _ = m(xi, None, packed_seq_params=psp)
        oi.backward(dy[a:b])
        outs.append(oi.detach())
        gxs.append(xi.grad)
    return torch.cat(outs), torch.cat(gxs), {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def test_thd_equals_per_sequence_runs_bf16(thd_ready):
    m = build_gdn(device="cuda", dtype=torch.bfloat16, **SHAPE)
    x = torch.randn(CU[-1], 1, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    out, gx, grads, dy = fwd_bwd(m, x, CU)
    ref_out, ref_gx, ref_grads = per_sequence(m, x, dy)
    worst = max(rel(grads[n], ref_grads[n]) for n in grads)
    print(f"\n[gdn-thd {MEGATRON} {'native' if NATIVE else 'shim'}] output max|diff|="
          f"{(out.float() - ref_out.float()).abs().max().item():.3g} rel={rel(out, ref_out):.3g} "
          f"bitwise={torch.equal(out, ref_out)} input-grad rel={rel(gx, ref_gx):.3g} worst param-grad rel={worst:.3g}")
    # The bar is upstream's own native THD on the same shape. Measured on an H200 (fla-core 0.4.2,
    # Triton 3.6): at this shape native 0.19.2 and the shim on 0.17.1 are bitwise identical to each
    # other and both differ from one-sequence runs by 1-ulp output differences (max |diff| 0.0625),
    # input-grad rel 1.8e-4, worst param-grad rel 5.4e-3; at hidden 1024 / 4+8 heads both gave
    # bitwise outputs and ~5e-5 input-grad rel. Bounds: one bf16 ulp for the output, 1.7x margin.
    assert rel(out, ref_out) <= 8e-3
    assert rel(gx, ref_gx) <= 3e-4
    assert worst <= 1e-2


def test_thd_matches_release_bshd_per_sequence_bf16(thd_ready):
    """Against the release's own unpacked forward (its conv and kernels), each sequence as batch 1."""
    m = build_gdn(device="cuda", dtype=torch.bfloat16, **SHAPE)
    x = torch.randn(CU[-1], 1, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    out, _, _, _ = fwd_bwd(m, x, CU)
    ref = torch.cat([m(x[a:b], None)[0].detach() for a, b in zip(CU, CU[1:])])
    err = rel(out, ref)
    print(f"\n[gdn-thd {MEGATRON}] vs release BSHD per sequence: output rel={err:.3g}")
    assert err < 1e-2


def test_no_leakage_between_sequences(thd_ready):
    m = build_gdn(device="cuda", dtype=torch.bfloat16, **SHAPE)
    x = torch.randn(CU[-1], 1, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    base, _, _, _ = fwd_bwd(m, x, CU)
    j = 3
    y = x.clone()
    y[CU[j]:CU[j + 1]] += 1
    out, _, _, _ = fwd_bwd(m, y, CU)
    keep = torch.ones(CU[-1], dtype=torch.bool, device="cuda")
    keep[CU[j]:CU[j + 1]] = False
    assert torch.equal(out[keep], base[keep])
    assert not torch.equal(out[~keep], base[~keep])


def test_no_host_sync_in_a_layer_call_once_the_pack_is_known(thd_ready):
    m = build_gdn(device="cuda", dtype=torch.bfloat16, **SHAPE)
    x = torch.randn(CU[-1], 1, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    psp = packed(CU)
    psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
    m(x, None, packed_seq_params=psp)[0].sum().backward()  # first call: validation, one host copy
    # a second layer sharing the pack
    syncs = host_syncs(lambda: m(x, None, packed_seq_params=psp)[0].sum().backward())
    print(f"\n[gdn-thd {MEGATRON} {'native' if NATIVE else 'shim'}] host syncs per layer call: {len(syncs)}")
    if not NATIVE:
        assert syncs == [], syncs[:3]


def _traced_fwd_bwd(m, x):
    """fwd_bwd that also keeps the tensors at the GDN core's edges: in_proj output and the
    out_proj input (everything between them is the code gdn_thd replaces), with their grads."""
    seen = {}

    def keep(name):
        def hook(mod, args, out):
            t = args[0] if name == "out_proj.input" else out[0]
            seen[name] = t.detach().clone()
            if t.requires_grad:
                t.register_hook(lambda g: seen.__setitem__(name + ".grad", g.detach().clone()))
        return hook

    handles = [m.in_proj.register_forward_hook(keep("in_proj.output")),
               m.out_proj.register_forward_hook(keep("out_proj.input"))]
    try:
        out, gx, grads, _ = fwd_bwd(m, x, CU)
    finally:
        for h in handles:
            h.remove()
    return {"output": out, "input grad": gx, **seen, **{f"grad {n}": g for n, g in grads.items()}}


def test_same_weights_same_bits_across_releases(thd_ready):
    """0.16/0.17 + shim and native 0.18/0.19 save their tensors; a later release's run compares.
    Must be bitwise: everything the patch computes (out_proj input, its grad, in_proj output's grad).
    Needs GDN_XVER_DIR, a fresh directory shared by this session's per-release runs (never a default:
    results an older run left behind would be compared as if they were this run's)."""
    if not XVER:
        pytest.skip("set GDN_XVER_DIR to a fresh directory shared by the per-release runs to compare releases")
    os.makedirs(XVER, exist_ok=True)
    torch.manual_seed(7)
    m = build_gdn(device="cuda", dtype=torch.bfloat16, seed=7, **SHAPE)
    x = torch.randn(CU[-1], 1, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16)
    mine = _traced_fwd_bwd(m, x)
    again = _traced_fwd_bwd(m, x)
    flaky = sorted(k for k in mine if not torch.equal(mine[k], again[k]))
    print(f"\n[xver {MEGATRON}] same-process run-to-run differences: {flaky or 'none'}")
    earlier = sorted(f for f in os.listdir(XVER) if f.endswith(("-shim.pt", "-native.pt")))
    torch.save({"state": m.state_dict(), "x": x, "t": mine}, f"{XVER}/{MEGATRON}-{'native' if NATIVE else 'shim'}.pt")
    if not NATIVE:
        return
    if not earlier:
        pytest.skip(f"no earlier results in {XVER}: run 0.16/0.17 first on the same machine")
    core = ["out_proj.input", "out_proj.input.grad", "in_proj.output.grad"]
    for name in earlier:
        blob = torch.load(f"{XVER}/{name}", map_location="cuda")
        m.load_state_dict(blob["state"])
        got = _traced_fwd_bwd(m, blob["x"])
        diff = {k: rel(got[k], blob["t"][k]) for k in got if not torch.equal(got[k], blob["t"][k])}
        print(f"[xver native {MEGATRON} vs {name}] not bitwise: {diff or 'none: all bitwise equal'}")
        assert not [k for k in core if k in diff], diff
        assert max(diff.values(), default=0.0) < 1e-3, diff
