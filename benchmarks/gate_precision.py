"""GDN gate precision (#22 item 5, #27 item 1): ``-A_log.exp()`` written in the parameter dtype (every release;
bf16 under megatron's Float16Module) against the fp32 exp that HF transformers and vLLM compute. CPU is enough.

    python -m benchmarks.gate_precision [--json FILE]     (from the repository root)

1. Per head: the relative error of the decay rate exp(A_log) *evaluated eagerly* over every bf16 value of A_log
   in megatron's init range (A ~ U(1, 16), A_log = log A), and for 32 heads drawn as megatron draws them.
2. 0.18/0.19: the release's own ``_compute_g_and_beta`` as users run it, compiled by megatron's jit_fuser
   (torch.compile, inductor on the CPU), and with dynamo off (eager), each against the fp64 formula.
3. 0.16/0.17: a packed micro-batch through a 4-layer GDN GPTModel in bf16 (gdn_compat's packed path, dynamo
   off as in the CPU suite, so its gate runs eagerly): per-token log-probs with the release's bf16 exp and
   with an fp32 exp, against the scale of bf16 itself (the same weights run in fp32). With megatron's default
   jit_fuser that gate is compiled and the difference is the compiled row of part 2: none to speak of.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F


def per_head() -> dict:
    lo, hi = math.log(1.0), math.log(16.0)
    grid = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # every bf16 value
    a_log = grid[(grid.float() >= lo) & (grid.float() <= hi)]
    rel = ((a_log.exp().float() - a_log.float().exp()) / a_log.float().exp()).abs()
    gen = torch.Generator().manual_seed(0)
    heads = torch.empty(32).uniform_(1, 16, generator=gen).log().to(torch.bfloat16)  # megatron's A_log init
    rel_heads = ((heads.exp().float() - heads.float().exp()) / heads.float().exp()).abs()
    return {"bf16 values in range": a_log.numel(), "max rel": rel.max().item(), "median rel": rel.median().item(),
            "32 init heads: max rel": rel_heads.max().item(), "32 init heads: median rel": rel_heads.median().item()}


def release_gate() -> dict:
    """The release's compiled gate (dynamo on) and its eager evaluation (dynamo off), against fp64."""
    import torch._dynamo
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    gen = torch.Generator().manual_seed(0)
    a_log = torch.empty(32).uniform_(1, 16, generator=gen).log().to(torch.bfloat16)
    dt = torch.randn(32, generator=gen).to(torch.bfloat16)
    alpha, beta = torch.randn(1, 4096, 32, generator=gen), torch.randn(1, 4096, 32, generator=gen)
    want = -a_log.double().exp() * F.softplus(alpha.double() + dt.double())
    out = {}
    for label, disable in (("compiled (megatron's default)", False), ("eager (dynamo off)", True)):
        old = torch._dynamo.config.disable
        torch._dynamo.config.disable = disable
        try:
            torch._dynamo.reset()
            g, _ = GatedDeltaNet._compute_g_and_beta(None, a_log, dt, alpha, beta)
        finally:
            torch._dynamo.config.disable = old
        out[f"{label}: max rel vs fp64"] = ((g.double() - want) / want).abs().max().item()
    return out


def model_logprobs() -> dict:
    import gdn_compat
    from gdn_compat.patches.gdn_thd import kernels
    from tests.support import model as M

    report = gdn_compat.apply()
    assert report["gdn_thd"].status == "applied", "run on megatron-core 0.16/0.17 (gdn_thd's CPU packed path)"
    shape = dict(hidden=256, dk=32, dv=32, hk=4, hv=8, ffn=512)
    lengths = [300, 17, 211, 140, 96]
    batch = M.packed_batch(lengths, None, seed=3)
    ids, pos, labels = (batch[k][None] for k in ("ids", "positions", "labels"))

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            loss = model(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels,
                         packed_seq_params=batch["psp"])
        return -loss.float()[0]  # the per-token cross entropy is -log p(label)

    bf16 = M.build(M.config(shape=shape, bf16=True, layers=4), seed=0)
    fp32 = M.build(M.config(shape=shape, layers=4), seed=0)
    fp32.load_state_dict({k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                          for k, v in bf16.state_dict().items()})
    release = logprobs(bf16)
    original = kernels.g_and_beta

    def fp32_exp(A_log, dt_bias, alpha, beta):
        g = -A_log.float().exp() * F.softplus(alpha.float() + dt_bias)
        return g, beta.sigmoid()

    kernels.g_and_beta = fp32_exp
    try:
        fixed = logprobs(bf16)
    finally:
        kernels.g_and_beta = original
    reference = logprobs(fp32)
    gate = (release - fixed).abs()
    noise = (release - reference).abs()
    return {"tokens": sum(lengths), "sequences": len(lengths),
            "release vs fp32 exp: max |dlogp|": gate.max().item(), "mean |dlogp|": gate.mean().item(),
            "bf16 vs fp32 model: max |dlogp|": noise.max().item(), "mean |dlogp| (bf16 scale)": noise.mean().item(),
            "sequence logprob, release vs fp32 exp: max |d|": max(
                (release[a:a + n] - fixed[a:a + n]).sum().abs().item()
                for a, n in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths)),
            "sequence logprob, bf16 vs fp32: max |d|": max(
                (release[a:a + n] - reference[a:a + n]).sum().abs().item()
                for a, n in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import gdn_compat
    from tests.support.megatron import world

    facts = gdn_compat.probe()
    out: dict = {"megatron_core": facts.megatron.version if facts.megatron else None, "per head": per_head()}
    with world():
        if facts.gdn_gate_method == "_compute_g_and_beta":
            out["release gate"] = release_gate()
        if facts.gdn_thd == "refuses":
            out["model, dynamo off"] = model_logprobs()
    for part, rows in out.items():
        if not isinstance(rows, dict):
            print(f"{part}: {rows}")
            continue
        print(part)
        for k, v in rows.items():
            print(f"  {k:<52} {v:.3g}" if isinstance(v, float) else f"  {k:<52} {v}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
