"""gdn_gate_fp32 (#22 item 5, opt-in): the decay gate's exp of A_log in fp32 on 0.18/0.19's real GatedDeltaNet.

The measurement that made it worth a patch is benchmarks/gate_precision.py (README, "GDN gate precision").
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gdn_compat
from tests.support.gdn import build_gdn, offsets, packed, packed_run, rel, use_torch_l2norm
from tests.support.release import FACTS, MEGATRON

pytestmark = pytest.mark.skipif(FACTS.gdn_gate_method != "_compute_g_and_beta",
                                reason=f"megatron-core {MEGATRON} has no _compute_g_and_beta ({FACTS.gdn_gate_exp})")
LENGTHS = [7, 1, 12]


def _plan():
    [rec] = [r for r in gdn_compat.plan(gdn_compat.probe(), gdn_gate_fp32=True) if r.name == "gdn_gate_fp32"]
    return rec


@pytest.fixture
def layer(megatron_cpu, monkeypatch):
    """fp32 but for a bf16 A_log (as under Float16Module), over megatron's init range: the gate's exp is then
    the only bf16 step, and packed and unpacked paths agree to fp32 rounding otherwise. The CPU suite runs with
    dynamo disabled (tests/support/megatron.py), so here the release's gate runs eagerly, as it does for users
    who disable dynamo; the compiled case is the last test."""
    if _plan().status != "would_apply":
        pytest.skip(f"gdn_gate_fp32 on {MEGATRON} with dynamo off: {_plan().reason}")
    use_torch_l2norm(monkeypatch)
    m = build_gdn(megatron_cpu, deterministic=True)  # the release's unpacked path runs on the CPU so
    m.A_log = torch.nn.Parameter(torch.linspace(0.1, 2.7, m.A_log.numel()).to(torch.bfloat16))
    return m


def _gate(layer):
    gen = torch.Generator().manual_seed(0)
    alpha = torch.randn(1, 16, layer.A_log.numel(), generator=gen)
    beta = torch.randn(1, 16, layer.A_log.numel(), generator=gen)
    g, b = layer._compute_g_and_beta(layer.A_log, layer.dt_bias, alpha, beta)
    want = -layer.A_log.double().exp() * F.softplus(alpha.double() + layer.dt_bias.double())  # float64
    return g, b, want


def test_the_release_takes_the_exp_of_a_bf16_a_log_in_bf16(layer):
    g, _, want = _gate(layer)
    assert g.dtype == torch.float32  # "In fp32", says its comment; the exp was bf16 all the same
    assert ((g.double() - want) / want).abs().max() > 1e-3


def test_patched_gate_is_fp32_and_beta_is_the_release_own(layer):
    _, beta_release, _ = _gate(layer)
    with gdn_compat.applied(gdn_gate_fp32=True) as report:
        assert report["gdn_gate_fp32"].status == "applied"
        g, beta, want = _gate(layer)
    assert ((g.double() - want) / want).abs().max() < 1e-6
    assert torch.equal(beta, beta_release)
    assert "_compute_g_and_beta" not in type(layer).__dict__ or FACTS.gdn == "module"  # reverted


def test_packed_calls_use_the_same_gate_as_unpacked_ones(layer):
    x = torch.randn(sum(LENGTHS), 1, 64, generator=torch.Generator().manual_seed(4))
    psp = packed(offsets(LENGTHS))
    with gdn_compat.applied():  # gdn_thd_deterministic's packed path, release gate
        release_pack = packed_run(layer, x, psp)[0]
    with gdn_compat.applied(gdn_gate_fp32=True):
        fp32_pack = packed_run(layer, x, psp)[0]
        starts = offsets(LENGTHS)
        fp32_alone = torch.cat([packed_run(layer, x[a:b], None)[0] for a, b in zip(starts, starts[1:])])
    print(f"[gate] packed vs unpacked, fp32 gate: {rel(fp32_pack, fp32_alone):.1e}; release gate packed vs fp32 "
          f"gate unpacked: {rel(release_pack, fp32_alone):.1e}")
    assert rel(fp32_pack, fp32_alone) < 1e-5  # the packed path computes the gate the unpacked one does
    assert rel(release_pack, fp32_alone) > 1e-4  # and that gate is not the release's


def test_with_dynamo_on_the_release_gate_is_already_fp32_and_the_patch_says_so(megatron_cpu):
    """megatron's default: jit_fuser is torch.compile. Compiled on the CPU (inductor), the release's own gate
    with a bf16 A_log is the fp32 formula, so gdn_gate_fp32 skips with that reason (the numerics evidence is
    the compiled run itself, not a dynamo-off stand-in)."""
    import torch._dynamo
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    gen = torch.Generator().manual_seed(0)
    a_log = torch.linspace(0.1, 2.7, 8).to(torch.bfloat16)  # megatron's init range, as bf16
    dt = torch.randn(8, generator=gen).to(torch.bfloat16)
    alpha, beta = torch.randn(1, 16, 8, generator=gen), torch.randn(1, 16, 8, generator=gen)
    with torch._dynamo.config.patch(disable=False):  # torch's own patch nests (a MonkeyPatch inside one deletes it)
        facts = gdn_compat.probe()
        if facts.gdn_gate_compiled != "yes":
            pytest.skip(f"the release's gate is not compiled here ({facts.gdn_gate_compiled})")
        [rec] = [r for r in gdn_compat.plan(facts, gdn_gate_fp32=True) if r.name == "gdn_gate_fp32"]
        assert rec.status == "skipped" and "runs compiled" in rec.reason and "already" in rec.reason
        torch._dynamo.reset()
        g, _ = GatedDeltaNet._compute_g_and_beta(None, a_log, dt, alpha, beta)  # the compiled method (self unused)
    torch._dynamo.reset()
    want = -a_log.double().exp() * F.softplus(alpha.double() + dt.double())
    err = ((g.double() - want) / want).abs().max().item()
    eager = -a_log.exp() * F.softplus(alpha.float() + dt)  # what the same expression gives without dynamo
    err_eager = ((eager.double() - want) / want).abs().max().item()
    print(f"[gate] release gate compiled: max rel {err:.1e} from the fp64 formula; eager bf16 exp: {err_eager:.1e}")
    assert err < 1e-6 < 1e-3 < err_eager
