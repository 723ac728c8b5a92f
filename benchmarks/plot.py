"""Charts of benchmarks/results/ (H200 runs):  python benchmarks/plot.py

gdn_thd.png: one GDN layer at 16,384 tokens (bench_gdn_thd.py), every mode, log scale.
stack.png:   one GDN layer at cp = 1 against pack size, gdn_compat on 0.17.1 and native 0.19.2
             (bench_stack.py); cp = 2 has no points until it is measured on two GPUs.
"""

from __future__ import annotations

import glob
import json
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(pattern: str) -> list[dict]:
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(HERE, "results", pattern)))]


def layer_modes(out: str) -> None:
    results = _load("h200-megatron-core-*.json")
    labels, values = [], []
    for r in results:
        for mode, row in r["rows"].items():
            labels.append(f"{r['megatron_core']}\n{mode.replace(' (gdn_compat)', '').replace(', ', chr(10))}")
            values.append(row["ms"])
    fig, ax = plt.subplots(figsize=(11, 4.2))
    colors = ["#2a9d8f" if "THD" in lab and "torch" not in lab else "#adb5bd" for lab in labels]
    bars = ax.bar(range(len(values)), values, color=colors)
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(values)), labels, fontsize=6)
    ax.set_ylabel("forward + backward, ms (median of 5, log)")
    r0 = results[0]
    ax.set_title(f"One GDN layer, Qwen3-Next size, {sum(r0['lengths'])} tokens in {len(r0['lengths'])} sequences, "
                 f"{r0['gpu']}, bf16", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def layer_vs_tokens(out: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in _load("h200-stack-*.json"):
        points = sorted((int(m.group(1)), row["ms"]) for name, row in r["rows"].items()
                        if (m := re.match(r"one GDN layer, cp=1, (\d+) tokens", name)))
        who = "native THD" if r["mode"] == "native" else "gdn_compat"
        ax.plot(*zip(*points), marker="o", label=f"{r['megatron_core']} {who}, cp = 1")
    ax.set_xlabel("tokens in the pack")
    ax.set_ylabel("forward + backward, ms (median of 10)")
    ax.set_title("One GDN layer, Qwen3-Next head shape, bf16, one H200, measured after the 8-layer stack\n"
                 "in the same process (cp = 2: not measured yet)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    layer_modes(os.path.join(HERE, "gdn_thd.png"))
    layer_vs_tokens(os.path.join(HERE, "stack.png"))
