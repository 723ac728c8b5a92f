"""Closer to training (#16): an 8-layer GDN + SwiGLU GPTModel (Qwen3-Next GDN head shape, hidden 2048,
FFN 4096, a 128-token vocabulary so the GDN/MLP stack dominates), bf16, forward + backward of the
per-token loss on one packed micro-batch; and one GDN layer at long context (cp = 1: time and peak
memory). CUDA graphs with a new pack every step: benchmarks/bench_graphs.py. Median of --reps after 3 warm-up steps; host syncs counted over one step.

    python -m benchmarks.bench_stack [--reps 10] [--json FILE]     (from the repository root)

Packs: rl = 16 sequences of 256-1,000 tokens (8,393); 16k = design.md's 9 sequences (16,384);
64k = 32,768 + 16,384 + 2 x 8,192 (65,536).
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.bench_gdn_thd import measure
from tests.support.gdn import DESIGN_LENGTHS, QWEN3_NEXT, RL_LENGTHS, build_gdn, host_syncs, offsets, packed

PACKS = {"rl": RL_LENGTHS, "16k": DESIGN_LENGTHS, "64k": [32768, 16384, 8192, 8192]}
STACK_SHAPE = dict(QWEN3_NEXT, ffn=4096)
LAYER_TOKENS = (16384, 65536, 131072)


def stack_rows(reps: int) -> dict:
    from tests.support import model as M

    model = M.build(M.config(shape=STACK_SHAPE, bf16=True, layers=8), seed=0, device="cuda")
    rows = {}
    for name, lengths in PACKS.items():
        batch = M.packed_batch(lengths, None)
        psp = batch["psp"]
        psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
        ids, pos, labels = (batch[k].cuda()[None] for k in ("ids", "positions", "labels"))

        def step(ids=ids, pos=pos, labels=labels, psp=psp, model=model):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels, packed_seq_params=psp)
            loss.float().sum().backward()

        ms, mib = measure(step, reps, warmup=3)
        rows[f"stack 8 layers, {name} pack ({sum(lengths)} tokens)"] = {
            "ms": round(ms, 2), "peak_mib": round(mib), "syncs_per_step": len(host_syncs(step))}
    del model
    torch.cuda.empty_cache()
    return rows


def layer_rows(reps: int, profile: bool = False) -> dict:
    rows = {}
    layer = build_gdn(device="cuda", dtype=torch.bfloat16, **QWEN3_NEXT)
    for tokens in LAYER_TOKENS:  # one long sequence plus a short one: a pack, not a batch
        lengths = [tokens - 4096, 4096]
        psp = packed(offsets(lengths))
        psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
        x = torch.randn(tokens, 1, QWEN3_NEXT["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step(x=x, psp=psp):
            layer(x, None, packed_seq_params=psp)[0].sum().backward()

        ms, mib = measure(step, reps, warmup=3)
        rows[f"one GDN layer, cp=1, {tokens} tokens"] = {"ms": round(ms, 2), "peak_mib": round(mib)}
        del x
        torch.cuda.empty_cache()
    lengths = RL_LENGTHS
    psp = packed(offsets(lengths))
    psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
    x = torch.randn(sum(lengths), 1, QWEN3_NEXT["hidden"], device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    xe = x.clone().requires_grad_(True)

    def eager():
        layer(xe, None, packed_seq_params=psp)[0].backward(dy)

    ms, _ = measure(eager, reps, warmup=3)
    rows[f"one GDN layer, rl pack ({sum(lengths)} tokens), eager"] = {"ms": round(ms, 2),
                                                                      "syncs_per_step": len(host_syncs(eager))}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                eager()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", choices=["stack", "layer"], default=None)
    ap.add_argument("--profile", action="store_true", help="torch profiler table of 3 eager rl-pack layer steps")
    args = ap.parse_args()
    from tests.support.megatron import world

    with world(cuda=True):
        import gdn_compat

        report = gdn_compat.apply()
        facts = report.facts
        mode = "native" if facts.gdn_thd == "native" else f"gdn_compat ({', '.join(report.applied)})"
        rows: dict = {}
        parts = {"stack": lambda: stack_rows(args.reps),
                 "layer": lambda: layer_rows(args.reps, profile=args.profile)}
        for name, part in parts.items():
            if args.only in (None, name):
                try:
                    rows.update(part())
                except Exception as exc:  # noqa: BLE001 - report, and still print the other part
                    print(f"[bench_stack] {name} failed: {type(exc).__name__}: {exc}")
    mc = facts.megatron.version if facts.megatron else None
    print(f"megatron-core {mc} THD {mode}; {facts.fla}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'what':<58}{'ms':>9}{'peak MiB':>10}{'syncs':>7}")
    for label, r in rows.items():
        print(f"{label:<58}{r['ms']:>9.2f}{r.get('peak_mib', ''):>10}{r.get('syncs_per_step', ''):>7}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"megatron_core": mc, "mode": mode, "fla": str(facts.fla), "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(), "packs": PACKS, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
