"""Loss curves of bench_train.py's runs, and the verdict "trains the same" (#38):  python benchmarks/plot_train.py

Defined before any run was looked at:
* a curve is the loss of every step smoothed by a centred mean over 11 steps (the data are different every step);
* the spread is the largest gap, from step 50 (after warm-up) to the end, between native 0.19.2 and native 0.19.2
  with another data order and init seed (``native-seed1``): how far two runs that should train the same drift;
* a configuration trains the same when its largest gap to native 0.19.2 (same data, same init seed) over the same
  steps is no larger than the spread, and its final loss (mean of the last 20 steps) lies below the data's unigram
  entropy (the model learned the task, so agreement is not that of two curves that learned nothing).

Writes benchmarks/results/h200-train.png (the curves, and tokens per second beside them) and prints one line per
configuration; exits non-zero when one does not train the same.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FROM = 50  # after warm-up
LABELS = {"native": "native", "native-seed1": "native, other data order + init", "default": "gdn_thd",
          "fused": "gdn_fused", "flashqla": "gdn_flashqla", "both": "both switches",
          "det-both": "both, deterministic_mode"}


def smooth(xs: list[float], half: int = 5) -> list[float]:
    return [statistics.fmean(xs[max(0, i - half):i + half + 1]) for i in range(len(xs))]


def gap(a: list[float], b: list[float]) -> float:
    sa, sb = smooth(a), smooth(b)
    return max(abs(x - y) for x, y in zip(sa[FROM:], sb[FROM:]))


def load() -> dict:
    runs = {}
    for path in sorted(glob.glob(os.path.join(HERE, "results", "h200-train-*.json"))):
        r = json.load(open(path))
        runs[f"{r['megatron_core']} {r['name']}"] = r
    return runs


def verdicts(runs: dict) -> tuple[float, dict]:
    base, other = runs["0.19.2 native"]["loss"], runs["0.19.2 native-seed1"]["loss"]
    spread = gap(base, other)
    out = {}
    for key, r in runs.items():
        if r["name"] == "native-seed1":
            continue
        final = statistics.fmean(r["loss"][-20:])
        g = gap(r["loss"], base)
        out[key] = {"gap": g, "final": final, "same": g <= spread and final < r["unigram_entropy"],
                    "tokens_per_s": r["tokens_per_s"], "peak_mib": r["peak_mib"], "ms": r["median_step_ms"]}
    return spread, out


def plot(runs: dict, spread: float, out_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    base = runs["0.19.2 native"]
    for key, r in runs.items():
        style = dict(lw=1.2)
        if r["name"] == "native-seed1":
            style = dict(lw=1.0, ls=":", color="grey")
        elif key == "0.19.2 native":
            style = dict(lw=2.0, color="black")
        ax.plot(smooth(r["loss"]), label=f"{r['megatron_core']} {LABELS.get(r['name'], r['name'])}", **style)
    ax.axhline(base["unigram_entropy"], color="grey", lw=0.8, ls="--")
    ax.text(len(base["loss"]) * 0.55, base["unigram_entropy"] + 0.08, "unigram entropy of the data", color="grey",
            fontsize=8)
    ax.set_xlabel("step (16,384 packed tokens, a new layout each step)")
    ax.set_ylabel("loss (11-step mean)")
    ax.set_title(f"8-layer GDN + SwiGLU, Qwen3-Next width, bf16 (spread of native seeds: {spread:.3f})", fontsize=9)
    ax.legend(fontsize=7)
    keys = [k for k, r in runs.items() if r["name"] != "native-seed1"]
    tps = [runs[k]["tokens_per_s"] / 1e3 for k in keys]
    bx.barh(range(len(keys)), tps, color=["black" if k == "0.19.2 native" else "tab:blue" for k in keys])
    bx.set_yticks(range(len(keys)), [f"{runs[k]['megatron_core']} {LABELS.get(runs[k]['name'], runs[k]['name'])}"
                                     for k in keys], fontsize=7)
    for i, k in enumerate(keys):
        bx.text(tps[i], i, f" {tps[i]:.0f}k ({runs['0.19.2 native']['median_step_ms'] / runs[k]['median_step_ms']:.2f}x)",
                va="center", fontsize=7)
    bx.set_xlabel("thousand tokens per second (H200)")
    bx.invert_yaxis()
    bx.set_xlim(0, max(tps) * 1.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


def main() -> int:
    runs = load()
    spread, out = verdicts(runs)
    print(f"spread (native vs native-seed1, steps {FROM}-end, 11-step means): {spread:.4f}")
    for key, v in out.items():
        print(f"{key:<24} gap to native {v['gap']:.4f}  final {v['final']:.4f}  {v['ms']:>7.2f} ms/step "
              f"{v['tokens_per_s']:>8} tok/s  peak {v['peak_mib']} MiB  {'same' if v['same'] else 'NOT THE SAME'}")
    plot(runs, spread, os.path.join(HERE, "results", "h200-train.png"))
    return 0 if all(v["same"] for v in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
