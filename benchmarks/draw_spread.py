"""How much of a fast path's distance from the fp32 truth is chance (#37 item 3): many output-gradient draws, the
default path run several times on each, every tensor's error per draw, on one GPU.

    python -m benchmarks.draw_spread [--shape qwen3.5-tp8] [--pack rl] [--draws 64] [--repeats 3]
                                     [--configs fused,flashqla,fused+flashqla] [--json FILE]
                                     (repository root, one GPU, megatron-core 0.18/0.19 for the native default)

tests/gpu/test_shapes_gpu.py judges a fast configuration by its distance from an fp32 truth (the same bf16 weights
and inputs in fp32, ``deterministic_mode``, every sequence alone) over the default path's distance, pooled over a
few draws. For a tensor of a few elements (a tp=8 shard's ``A_log``: 8 values) that ratio moves by chance, and
outside deterministic mode the default path's bf16 backward need not be bitwise repeatable (fla's kernels), so its
distance could move between two runs of the same draw too. This script measures both, on the same draws:

- ``default#1`` .. ``default#R``: the default packed path (native THD on 0.18/0.19) run R times on every draw. The
  ratio of run r's pooled error to run 1's is what the test would see if the fast path were native itself.
- each configuration, run twice per draw (the draws where its two runs differ are counted and printed).
- per tensor: pooled error of every run, the ratio of each configuration to ``default#1`` and to the default's
  distance pooled over all R runs, a bootstrap 5-95% interval of the latter (draws resampled, 2,000 times), and the
  ratios over consecutive blocks of 16 draws (what one 16-draw test run would have seen).
Results go to the JSON every fourth draw and after the last, so a run cut short keeps most of what it measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from benchmarks.bench_fast import CONFIGS as ALL_CONFIGS
from benchmarks.bench_fast import NotTaken, cuda_psp
from tests.support.gdn import LAYER_SHAPES, RL_LENGTHS, build_gdn, fp32_truth, packed_run

PACKS = {"rl": RL_LENGTHS, "64k": [65536], "32k": [32768]}
CONFIGS = {c: s for c, s in ALL_CONFIGS.items() if s}  # the fast ones; the default path is run --repeats times
BLOCK = 16  # draws per block: what test_shapes_gpu pooled for 8 value heads before its 512-value rule


def _errors(run, want: dict) -> dict[str, float]:
    out, dx, grads = run
    got = {"out": out, "dx": dx, **grads}
    return {n: (got[n].float() - w.float()).norm().item() ** 2 for n, w in want.items()}


def summary(rec: dict, repeats: int, configs: list[str]) -> dict:
    """Per tensor: pooled errors, ratios, bootstrap interval, 16-draw blocks (module docstring)."""
    n = len(rec["den"])
    gen = torch.Generator().manual_seed(0)
    boots = torch.randint(0, n, (2000, n), generator=gen)
    out = {}
    for name in rec["den"][0]:
        den = torch.tensor([d[name] for d in rec["den"]], dtype=torch.float64)
        err = {run: torch.tensor([e[name] for e in rec["err"][run]], dtype=torch.float64) for run in rec["err"]}
        default_all = sum(err[f"default#{r}"] for r in range(1, repeats + 1)) / repeats  # mean over the R runs

        def ratio(num, base, idx=slice(None)):
            return float((num[idx].sum() / base[idx].sum()).sqrt())

        t: dict = {"pooled": {run: float((e.sum() / den.sum()).sqrt()) for run, e in err.items()},
                   "null": {f"default#{r}/default#1": ratio(err[f"default#{r}"], err["default#1"])
                            for r in range(2, repeats + 1)},
                   "vs default#1": {c: ratio(err[c], err["default#1"]) for c in configs},
                   "vs default (all runs)": {c: ratio(err[c], default_all) for c in configs}}
        t["bootstrap 5-95% vs default (all runs)"] = {
            c: [round(float(q), 3) for q in torch.quantile(
                (err[c][boots].sum(1) / default_all[boots].sum(1)).sqrt(), torch.tensor([0.05, 0.95], dtype=torch.float64))]
            for c in configs}
        blocks = [slice(i, i + BLOCK) for i in range(0, n - BLOCK + 1, BLOCK)]
        t[f"blocks of {BLOCK} vs default#1"] = {run: [round(ratio(err[run], err["default#1"], b), 3) for b in blocks]
                                                for run in err if run != "default#1"}
        out[name] = t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-tp8", choices=sorted(LAYER_SHAPES))
    ap.add_argument("--pack", default="rl", choices=sorted(PACKS))
    ap.add_argument("--draws", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs of the default path per draw")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--focus", default="A_log,dt_bias", help="tensors printed per draw (all go to the JSON)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    configs = args.configs.split(",")
    if bad := [c for c in configs if c not in CONFIGS]:
        ap.error(f"unknown configs {bad}: expected some of {sorted(CONFIGS)}")
    if args.repeats < 2 or args.draws < 1:
        ap.error(f"--repeats {args.repeats} / --draws {args.draws}: need at least 2 repeats and 1 draw")
    from torch._dynamo import config as dynamo_config

    import gdn_compat
    from tests.support.megatron import world

    setattr(dynamo_config, "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit", 64)
    said = NotTaken()
    logging.getLogger("gdn_compat").addHandler(said)
    lengths = PACKS[args.pack]
    dims, hk, hv = LAYER_SHAPES[args.shape]
    rec: dict = {"den": [], "err": {}, "not bitwise repeatable": {c: 0 for c in configs}}
    with world(cuda=True):
        facts = gdn_compat.probe(init_cuda=True)
        result: dict = {"megatron_core": facts.megatron.version if facts.megatron else None, "fla": str(facts.fla),
                        "flashqla": str(facts.flashqla), "torch": torch.__version__,
                        "gpu": torch.cuda.get_device_name(), "shape": args.shape, "heads": [hk, hv],
                        "pack": args.pack, "tokens": sum(lengths), "repeats": args.repeats}
        layer = build_gdn(device="cuda", dtype=torch.bfloat16, seed=4, hk=hk, hv=hv, **dims)  # as test_shapes_gpu
        ref = build_gdn(device="cuda", dtype=torch.float32, deterministic=True, seed=4, hk=hk, hv=hv, **dims)
        ref.load_state_dict({k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                             for k, v in layer.state_dict().items()})
        gen = torch.Generator(device="cuda").manual_seed(12)
        x = torch.randn(sum(lengths), 1, dims["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
        psp = cuda_psp(lengths)
        t0 = time.time()
        for i in range(args.draws):
            dy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
            want = fp32_truth(ref, x, [dy], lengths)[0]
            rec["den"].append({n: w.float().norm().item() ** 2 for n, w in want.items()})
            with gdn_compat.applied():
                for r in range(1, args.repeats + 1):
                    rec["err"].setdefault(f"default#{r}", []).append(_errors(packed_run(layer, x, psp, dy), want))
            for c in configs:
                with gdn_compat.applied(**CONFIGS[c]) as report:
                    assert all(report[s].status == "applied" for s in CONFIGS[c]), report
                    a, b = packed_run(layer, x, psp, dy), packed_run(layer, x, psp, dy)
                rec["not bitwise repeatable"][c] += not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and all(
                    torch.equal(a[2][k], b[2][k]) for k in a[2]))
                rec["err"].setdefault(c, []).append(_errors(a, want))
            del want
            row = {n: " ".join(f"{run} {(rec['err'][run][-1][n] / rec['den'][-1][n]) ** 0.5:.2e}"
                               for run in rec["err"]) for n in args.focus.split(",")}
            print(f"[draw_spread] draw {i + 1}/{args.draws} (+{time.time() - t0:.0f} s): "
                  + "; ".join(f"{n}: {v}" for n, v in row.items()), flush=True)
            if (i + 1) % 4 == 0 or i + 1 == args.draws:
                result.update(draws=i + 1, said=sorted(set(said.reasons)), bitwise=rec["not bitwise repeatable"],
                              tensors=summary(rec, args.repeats, configs))
                if args.json:
                    with open(args.json, "w") as fh:
                        json.dump(result, fh, indent=1)
        for name, t in result["tensors"].items():
            print(f"[draw_spread] {args.shape}:{args.pack} {name:<20} null {t['null']}  vs default#1 "
                  f"{ {c: round(v, 3) for c, v in t['vs default#1'].items()} }  vs all default runs "
                  f"{ {c: round(v, 3) for c, v in t['vs default (all runs)'].items()} }  "
                  f"boot {t['bootstrap 5-95% vs default (all runs)']}", flush=True)
        print(f"[draw_spread] blocks of {BLOCK} (A_log): {result['tensors'].get('A_log', {}).get(f'blocks of {BLOCK} vs default#1')}")
        print(f"[draw_spread] fast configs not bitwise repeatable in N draws: {rec['not bitwise repeatable']}; "
              f"said {sorted(set(said.reasons))}")


if __name__ == "__main__":
    main()
