"""The doctor's kernel-stack prediction against what a real GDN backward does on this GPU."""

from __future__ import annotations

import pytest
import torch

import gdn_compat
from gdn_compat import hazards
from gdn_compat._probe import probe
from tests.support.gdn import build_gdn, packed


@pytest.mark.parametrize("dk", [128])
def test_doctor_predicts_what_the_first_gdn_backward_does(megatron_cpu, dk):
    facts = probe(init_cuda=True)
    findings = {f.code: f for f in hazards.check(facts, key_head_dim=dk)}
    print(f"\n[doctor {facts.megatron} {facts.fla} triton {facts.triton} {facts.gpu}] "
          f"{[str(f) for f in findings.values()]}")
    gdn_compat.apply()
    try:
        m = build_gdn(device="cuda", dtype=torch.bfloat16, hidden=2048, dk=dk, dv=128, hk=16, hv=32)
        x = torch.randn(256, 1, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        psp = packed([0, 100, 256])
        psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
        out, _ = m(x, None, packed_seq_params=psp)
        if "fla-640-crash" in findings:
            with pytest.raises(RuntimeError) as err:
                out.sum().backward()
            print(f"[doctor] predicted crash happened: {str(err.value)[:200]}")
        else:
            out.sum().backward()
            assert x.grad is not None and torch.isfinite(x.grad).all()
            print("[doctor] no crash predicted, backward ran")
    finally:
        gdn_compat.revert()
