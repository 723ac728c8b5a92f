"""Upstream's own THD contract on every release (#27 item 2): a packed call equals the same layer run unpacked.

NVIDIA/Megatron-LM PR #2645 added ``test_gpu_forward_thd_correctness`` and ``test_gpu_forward_thd_padding_correctness``
(tests/unit_tests/ssm/test_gated_delta_net.py, read at tag core_v0.19.0): Qwen3-Next's GDN shape in bf16, four
sequences of 32 tokens (``torch.rand`` input) packed as THD against the same four as an sbhd batch, and the same
with 30 real tokens in slots of 32; ``assert_close(atol=3e-4, rtol=3e-4)``. Written here anew with megatron's
local modules instead of Transformer Engine's specs (torch's RMSNorm, so no zero-centered gamma).

On 0.18/0.19 the release meets it. On 0.16/0.17 gdn_thd's packed calls run 0.19's kernels while unpacked calls
run the release's bf16 ``nn.Conv1d`` and bf16 gate, so the default does not (the mismatch is printed);
``gdn_thd_unpacked`` routes unpacked calls through the same kernels, and then it must hold.
"""

from __future__ import annotations

import pytest
import torch

import gdn_compat
from tests.support.gdn import QWEN3_NEXT, build_gdn, packed
from tests.support.release import FACTS, MEGATRON

TOL = dict(atol=3e-4, rtol=3e-4)


def _outside(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got.float() - want.float()).abs() > TOL["atol"] + TOL["rtol"] * want.float().abs()
    return (f"{bad.float().mean().item() * 100:.1f}% of elements outside atol=rtol=3e-4, max |diff| "
            f"{(got.float() - want.float()).abs().max().item():.4g}")


def _cases(layer):
    torch.manual_seed(0)
    sbhd = torch.rand(32, 4, QWEN3_NEXT["hidden"], device="cuda").bfloat16()
    thd = sbhd.transpose(0, 1).contiguous().view(-1, 1, QWEN3_NEXT["hidden"])
    with torch.no_grad():
        unpacked = layer(sbhd, None)[0].transpose(0, 1).contiguous()  # [4, 32, H]
        plain = packed([0, 32, 64, 96, 128])
        padded = packed([0, 30, 60, 90, 120], padded=[0, 32, 64, 96, 128])
        for psp in (plain, padded):
            for f in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
                if getattr(psp, f) is not None:
                    setattr(psp, f, getattr(psp, f).cuda())
        out_plain = layer(thd, None, packed_seq_params=plain)[0].view(4, 32, -1)
        out_padded = layer(thd, None, packed_seq_params=padded)[0].view(4, 32, -1)
    return {"thd_correctness": (out_plain, unpacked), "thd_padding_correctness": (out_padded[:, :30], unpacked[:, :30])}


@pytest.fixture
def layer(megatron_cpu):
    assert megatron_cpu == "cuda"
    if FACTS.gdn_thd not in ("native", "refuses"):
        pytest.skip(f"megatron-core {MEGATRON} has no GatedDeltaNet")
    return build_gdn(device="cuda", dtype=torch.bfloat16, seed=1, **QWEN3_NEXT)


def test_upstreams_thd_tests_hold(layer):
    native = FACTS.gdn_thd == "native"
    with gdn_compat.applied() as report:
        default = _cases(layer)
    lines = [f"  default ({'native THD' if native else report['gdn_thd'].status + ' gdn_thd'}): "
             + "; ".join(f"{k}: {_outside(*v)}" for k, v in default.items())]
    cases = default
    if not native:
        with gdn_compat.applied(gdn_thd_unpacked=True) as report:
            assert report["gdn_thd_unpacked"].status == "applied", report["gdn_thd_unpacked"]
            cases = _cases(layer)
        lines.append("  gdn_thd_unpacked: " + "; ".join(f"{k}: {_outside(*v)}" for k, v in cases.items()))
    print(f"\n[upstream-thd {MEGATRON}]\n" + "\n".join(lines))
    for name, (got, want) in cases.items():
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
