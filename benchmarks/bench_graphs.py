"""CUDA graphs with a new pack every step (#21): bench_stack's 8-layer GDN + SwiGLU GPTModel (Qwen3-Next GDN
head shape, bf16), forward + backward of the masked per-token loss, a different layout in every step.

    python -m benchmarks.bench_graphs [--reps 20] [--json FILE]      (from the repository root)

Budgets: rl = 10,240 tokens in 16 sequences of 256-1,024 tokens (a new random split every step);
16k = 16,384 tokens in 4-16 sequences (offsets padded to 17 entries with empty sequences). Per budget:
eager (the release's path: gdn_compat's host path on 0.16/0.17, native THD on 0.18/0.19; a fresh
PackedSeqParams every step, as a loader hands it) and, where gdn_compat's graph-safe path is applied
(0.16/0.17; 0.18/0.19 with apply(gdn_thd_graph_safe=True)), one capture replayed for every layout. A
timed step includes writing the batch into the static buffers. Median of --reps after 3 warm-up steps;
capture time, the graph pool's memory and the number of captures are reported.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from benchmarks.bench_gdn_thd import measure
from tests.support.gdn import QWEN3_NEXT, offsets

STACK_SHAPE = dict(QWEN3_NEXT, ffn=4096)


def layouts(budget: int, count: int, seqs: tuple[int, int], lo: int, hi: int, seed: int) -> list[list[int]]:
    """``count`` random packs of exactly ``budget`` tokens, each of ``seqs`` sequences of lo..hi tokens."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        n = rng.randint(*seqs)
        lengths = [lo] * n
        left = budget - lo * n
        while left > 0 and any(x < hi for x in lengths):
            i = rng.randrange(n)
            add = min(left, rng.randint(1, 96), hi - lengths[i])
            lengths[i] += add
            left -= add
        if left == 0:
            out.append(lengths)
    return out


BUDGETS = {"rl": (10240, (16, 16), 256, 1024), "16k": (16384, (4, 16), 512, 4096)}


def rows_for(model, name: str, reps: int, graphed: bool) -> dict:
    import gdn_compat
    from tests.support import model as M

    budget, seqs, lo, hi = BUDGETS[name]
    packs = layouts(budget, reps + 3, seqs, lo, hi, seed=7)
    batches = [M.packed_batch(p, None, seed=i) for i, p in enumerate(packs)]
    ids, pos, labels, mask = (torch.zeros(1, budget, dtype=dt, device="cuda")
                              for dt in (torch.long, torch.long, torch.long, torch.float32))

    def fill(batch) -> None:
        for static, key in ((ids, "ids"), (pos, "positions"), (labels, "labels"), (mask, "mask")):
            static.copy_(batch[key][None], non_blocking=True)

    def forward_backward(psp):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels, packed_seq_params=psp)
        total = (loss.float() * mask).sum()
        total.backward()
        return total

    turn = iter(range(10**9))
    rows = {}

    def eager():
        batch = batches[next(turn) % len(batches)]
        fill(batch)
        psp = batch["psp"]
        psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda(non_blocking=True)  # a new tensor per step
        forward_backward(psp)

    ms, mib = measure(eager, reps, warmup=3)
    rows[f"{name}: eager, new layout every step"] = {"ms": round(ms, 2), "peak_mib": round(mib)}
    if graphed:
        buf = gdn_compat.graphs.PackBuffer(budget, 16, device="cuda")
        buf.load(offsets(packs[0]))
        fill(batches[0])
        torch.cuda.synchronize()
        before, t0 = torch.cuda.memory_reserved(), time.perf_counter()
        graph, _ = gdn_compat.graphs.capture(lambda: forward_backward(buf.params))
        torch.cuda.synchronize()
        capture_s, pool = time.perf_counter() - t0, (torch.cuda.memory_reserved() - before) / 2**20

        def replay():
            i = next(turn) % len(batches)
            buf.load(offsets(packs[i]))
            fill(batches[i])
            graph.replay()

        ms_g, mib_g = measure(replay, reps, warmup=3)
        rows[f"{name}: CUDA graph, one capture, new layout every step"] = {
            "ms": round(ms_g, 2), "peak_mib": round(mib_g), "capture_s": round(capture_s, 1),
            "graph_pool_mib": round(pool), "captures": 1}
        del graph
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--budgets", default="rl,16k")
    ap.add_argument("--graph-safe", action="store_true", help="0.18/0.19: apply(gdn_thd_graph_safe=True) and graph")
    args = ap.parse_args()
    from torch._dynamo import config as dynamo_config

    from tests.support import model as M
    from tests.support.megatron import world

    setattr(dynamo_config, "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit", 64)
    with world(cuda=True):
        import gdn_compat

        report = gdn_compat.apply(**({"gdn_thd_graph_safe": True} if args.graph_safe else {}))
        facts = report.facts
        graphed = bool({"gdn_thd", "gdn_thd_graph_safe"} & set(report.applied))
        mode = ("native THD" if facts.gdn_thd == "native" and not graphed
                else f"gdn_compat ({', '.join(report.applied)})")
        model = M.build(M.config(shape=STACK_SHAPE, bf16=True, layers=8), seed=0, device="cuda")
        rows: dict = {}
        for name in args.budgets.split(","):
            rows.update(rows_for(model, name, args.reps, graphed))
            torch.cuda.empty_cache()
    mc = facts.megatron.version if facts.megatron else None
    print(f"megatron-core {mc}, {mode}; {facts.fla}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'what':<52}{'ms':>9}{'peak MiB':>10}{'capture s':>11}{'pool MiB':>10}")
    for label, r in rows.items():
        print(f"{label:<52}{r['ms']:>9.2f}{r['peak_mib']:>10}{r.get('capture_s', ''):>11}{r.get('graph_pool_mib', ''):>10}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"megatron_core": mc, "mode": mode, "fla": str(facts.fla), "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(), "budgets": BUDGETS, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
