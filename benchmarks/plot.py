"""Bar chart of benchmarks/results/*.json (from bench_gdn_thd.py): python benchmarks/plot.py OUT.png"""

from __future__ import annotations

import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out: str) -> None:
    results = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "results", "*.json")))]
    labels, values = [], []
    for r in results:
        for mode, row in r["rows"].items():
            labels.append(f"{r['megatron_core']}\n{mode}")
            values.append(row["ms"])
    fig, ax = plt.subplots(figsize=(9, 3.8))
    colors = ["#2a9d8f" if "THD" in lab else "#adb5bd" for lab in labels]
    bars = ax.bar(range(len(values)), values, color=colors)
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylim(0, 1.12 * max(values))
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("forward + backward, ms (median of 5)")
    r0 = results[0]
    ax.set_title(f"One GDN layer, Qwen3-Next size, {sum(r0['lengths'])} tokens in {len(r0['lengths'])} sequences, "
                 f"{r0['gpu']}, bf16", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/gdn_thd.png")
