"""The benchmark tables of the README and docs/, rendered from ``benchmarks/results/*.json`` (stdlib only).

``nox -s numbers`` writes each between its markers in its home file (``HOME``); ``tests/test_numbers.py`` fails when
a table no longer is what its results file renders to (a number typed by hand, or a results file replaced without the
table). Each table names the file it comes from. The README holds two small ones (what packing and the fast paths
buy); the detail lives in docs/results.md, and the CP modes' costs in docs/context-parallel.md.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FAST = ("default", "fused", "flashqla", "fused+flashqla")
LABEL = {"default": "default (native 0.19.2)", "fused": "`gdn_fused`", "flashqla": "`gdn_flashqla`",
         "fused+flashqla": "both"}


def _load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


def _source(name: str) -> str:
    return f"<sub>from `benchmarks/results/{name}`</sub>"


def fast_layer(name: str = "h200-fast-layers-0.19.2.json") -> str:
    """One Qwen3-Next GDN layer, each fast configuration: wall / GPU kernel ms for the 16k and RL packs (wall speedup
    against the default), saved bytes per token (16k), the 64k peak."""
    data = _load(name)
    rows = ["| | 16k pack: wall / GPU kernels | RL pack: wall / GPU kernels | saved bytes/token | 64k peak |",
            "|---|---|---|---|---|"]
    for config in FAST:
        packs = data["layer"][config]["packs"]
        cells = []
        for pack in ("16k", "rl"):
            p = packs[pack]
            speed = "" if config == "default" else f" ({p['speedup']:.2f}x)"
            cells.append(f"{p['wall_ms']:.2f} / {p['kernels_ms']['total']:.2f} ms{speed}")
        peak = data["peak_64k"][config]["peak_mib"]
        rows.append(f"| {LABEL[config]} | {cells[0]} | {cells[1]} | {packs['16k']['saved_bytes_per_token']:,} | "
                    f"{peak:,} MiB |")
    return "\n".join(rows) + "\n\n" + _source(name)


def fast_stack(name: str = "h200-fast-stack-0.19.2.json") -> str:
    """The 8-layer stack at the RL budget, a new layout every step: eager and one-CUDA-graph ms per configuration,
    the best graphed row's speedup against native eager."""
    stack = _load(name)["stack"]

    def ms(config: str, mode: str) -> float | None:
        key = next((k for k in stack if k.startswith(f"{config}: rl: ") and mode in k), None)
        return None if key is None else stack[key]["ms"]

    native = ms("default", "eager")
    assert native is not None, f"{name} has no native eager stack row"
    graphed = {c: ms(c, "CUDA graph") for c in FAST}
    best = min((v, c) for c, v in graphed.items() if v is not None)[1]
    head = "| | native 0.19.2 | `gdn_fused` | `gdn_flashqla` | both |"

    def cell(config: str, value: float | None) -> str:
        if value is None:
            return "–"
        text = f"{value:.1f} ms"
        return f"**{text} ({native / value:.2f}x)**" if config == best and value is graphed[config] else text

    eager = "| eager | " + " | ".join(cell(c, ms(c, "eager")) for c in FAST) + " |"
    graph = "| one CUDA graph, every layout | " + " | ".join(cell(c, graphed[c]) for c in FAST) + " |"
    return "\n".join([head, "|---|---|---|---|---|", eager, graph]) + "\n\n" + _source(name)


def thd_modes() -> str:
    """One GDN layer at Qwen3-Next size, 16k tokens in 9 sequences: each mode's ms and host syncs per layer call."""
    rows = ["| megatron-core | mode | ms | host syncs per layer call |", "|---|---|---|---|"]
    picks = [("0.17.1", "THD shim (applied)", "0.17.1 + `gdn_thd`", "THD packed"),
             ("0.19.2", "THD native", "0.19.2", "THD packed (upstream native)"),
             ("0.17.1", "THD deterministic (gdn_compat)", "0.17.1 + `gdn_thd`, `deterministic_mode`",
              "THD packed (upstream refuses it)"),
             ("0.17.1", "padded BSHD", "0.17.1", "right-padded BSHD (the release's code)"),
             ("0.17.1", "per-sequence loop", "0.17.1", "one call per sequence (the release's code)")]
    best = min(_load(f"h200-megatron-core-{v}.json")["rows"][r]["ms"] for v, r, _, _ in picks[:3])
    for version, row, who, mode in picks:
        found = _load(f"h200-megatron-core-{version}.json")["rows"][row]
        text, syncs = f"{found['ms']:.2f}", found.get("syncs_per_call")
        bold = found["ms"] == best and row != "THD deterministic (gdn_compat)"
        rows.append(f"| {who} | {mode} | {f'**{text}**' if bold else text} | "
                    f"{'–' if syncs is None else (f'**{syncs}**' if syncs == 0 and bold else syncs)} |")
    return "\n".join(rows) + "\n\n" + _source("h200-megatron-core-0.17.1.json, h200-megatron-core-0.19.2.json")


def train() -> str:
    """bench_train's runs (#38): per configuration the step time, tokens per second (against native 0.19.2), peak
    memory, final loss and the largest gap of its curve to native's, judged as benchmarks/plot_train.py judges."""
    from benchmarks import plot_train

    runs = plot_train.load()
    spread, verdict = plot_train.verdicts(runs)
    native = runs["0.19.2 native"]
    rows = ["| megatron-core | configuration | ms / step | tokens/s | peak | final loss | largest gap to native | "
            "trains the same |", "|---|---|---|---|---|---|---|---|"]
    order = ["native", "native-seed1", "default", "fused", "flashqla", "both", "det-both"]
    for key, r in sorted(runs.items(), key=lambda kv: (kv[1]["megatron_core"] != "0.19.2",
                                                        order.index(kv[1]["name"]) if kv[1]["name"] in order else 99)):
        label = plot_train.LABELS.get(r["name"], r["name"])
        if key not in verdict:  # the spread's own run
            rows.append(f"| {r['megatron_core']} | {label} | {r['median_step_ms']:.1f} | {r['tokens_per_s']:,} | "
                        f"{r['peak_mib']:,} MiB | {sum(r['loss'][-20:]) / 20:.3f} | **{spread:.3f}** (the spread) | – |")
            continue
        v = verdict[key]
        speed = native["median_step_ms"] / r["median_step_ms"]
        rows.append(f"| {r['megatron_core']} | {label} | {r['median_step_ms']:.1f} | {r['tokens_per_s']:,} "
                    f"({speed:.2f}x) | {r['peak_mib']:,} MiB | {v['final']:.3f} | {v['gap']:.3f} | "
                    f"{'yes' if v['same'] else '**no**'} |")
    return "\n".join(rows) + "\n\n" + f"<sub>from `benchmarks/results/h200-train-*.json` ({len(runs)} runs)</sub>"


def long_rows(name: str = "h200-long-0.19.2.json") -> str:
    """bench_long's rows (#37): per layer shape and pack, each configuration's wall / GPU-kernel ms (kernel-time
    speedup against native 0.19.2), whether FlashQLA's intra-card CP ran, and the peaks of native and both; "graph-safe"
    (a PackBuffer's offsets, what a captured step runs) only where a run measured it."""
    data = _load(name)
    configs = ["default", "fused", "flashqla", "fused+flashqla", "fused+flashqla/no-cp", "fused+flashqla/graph-safe"]
    head = ("| layer (local heads k / v) | pack | native 0.19.2 | `gdn_fused` | `gdn_flashqla` | both | "
            "both, no intra-card CP | both, graph-safe | peak native / both |")
    rows = [head, "|---|---|---|---|---|---|---|---|---|"]
    for key, r in data["rows"].items():
        shape, pack = key.split(":")
        dims, hk, hv = data["shapes"][shape]
        cells = []
        for c in configs:
            if c not in r:
                cells.append("–")
                continue
            x = r[c]
            text = f"{x['wall_ms']:.2f} / {x['kernels_ms']['total']:.2f}"
            if c != "default":
                text += f" ({x['speedup_kernels']:.2f}x)"
            if x.get("intra_cp"):
                text += " CP"
            cells.append(text)
        peak = f"{r['default']['peak_mib']:,} / {r['fused+flashqla']['peak_mib']:,} MiB" if "fused+flashqla" in r else "–"
        rows.append(f"| {shape} (hidden {dims['hidden']}, {hk} / {hv}) | {pack} | " + " | ".join(cells) + f" | {peak} |")
    return "\n".join(rows) + "\n\n" + _source(name)


def cost_layer() -> str:
    """The README's one-layer table: 0.17.1 padded (what its users do without gdn_compat), packed with gdn_thd, and
    native 0.19.2 packed; the speedup of packing over padding."""
    rows = {v: _load(f"h200-megatron-core-{v}.json")["rows"] for v in ("0.17.1", "0.19.2")}
    padded, packed, native = (rows["0.17.1"]["padded BSHD"]["ms"], rows["0.17.1"]["THD shim (applied)"]["ms"],
                              rows["0.19.2"]["THD native"]["ms"])
    return "\n".join([
        "| one GDN layer, 16k tokens in 9 sequences, forward + backward | ms (`h200-megatron-core-*.json`) |",
        "|---|---|",
        f"| megatron-core 0.17.1 alone: padded to the longest sequence | {padded:.2f} |",
        f"| 0.17.1 + `gdn_thd`: packed | **{packed:.2f}** ({padded / packed:.1f}x faster) |",
        f"| native 0.19.2: packed | {native:.2f} |"])


def cost_train() -> str:
    """The README's training table: tokens per second of gdn_thd and of both fast paths against native 0.19.2, and
    whether each trains the same (benchmarks/plot_train.py's verdict)."""
    from benchmarks import plot_train

    runs = plot_train.load()
    _, verdict = plot_train.verdicts(runs)
    native = runs["0.19.2 native"]["median_step_ms"]
    rows = ["| 8-layer GDN model, 300 steps of 16k packed tokens | tokens/s (`h200-train-*.json`) | trains the same as "
            "native 0.19.2 |", "|---|---|---|"]
    for key, label in (("0.19.2 native", "native 0.19.2"), ("0.17.1 default", "0.17.1 + `gdn_thd`"),
                       ("0.17.1 both", "0.17.1 + `gdn_thd`, `gdn_fused`, `gdn_flashqla`")):
        r, v = runs[key], verdict.get(key)
        same = "–" if key == "0.19.2 native" else ("yes" if v["same"] else "**no**") + (
            ", bitwise" if v["gap"] == 0 else f" (largest gap {v['gap']:.2f}, within the seed spread)" if v["same"] else "")
        rows.append(f"| {label} | {r['tokens_per_s']:,} ({native / r['median_step_ms']:.2f}x) | {same} |")
    return "\n".join(rows)


def step0(before: str = "h100-step0-spread-0.19.2-as-before.json", after: str = "h100-step0-spread-0.19.2.json") -> str:
    """benchmarks/step0_spread.py (#53): each configuration's step-0 loss with the harness as it was (models built one
    after another in a process, the CUDA RNG tracker not reseeded) and as it is, against the fp32 run of native's
    weights, and with the same weights each decoder layer's output distance from the fp32 run (first / last layer)."""
    old, new = _load(before), _load(after)
    fp32 = new["fp32"]["loss"]
    rows = [f"| configuration | weights as before | step-0 loss as before | weights now | step-0 loss now (fp32 "
            f"{fp32:.4f}) | layer 1 / layer 8 rel. to fp32 |", "|---|---|---|---|---|---|"]
    for name, r in new["configs"].items():
        o = old["configs"][name]
        same, was = (("native's" if x["same_weights_as_fp32_run"] else "**other**") for x in (r, o))
        dist = r["layer_rel_to_fp32"]
        rows.append(f"| {plain(name)} | {was} | "
                    f"{o['loss']:.4f} | {same} | {r['loss']:.4f} ({r['loss'] - fp32:+.4f}) | "
                    f"{dist[0]:.4f} / {dist[-1]:.4f} |")
    return "\n".join(rows) + "\n\n" + f"<sub>from `benchmarks/results/{before}` and `{after}`</sub>"


def cp_state(name: str = "h100-cp-state-0.19.2.json", key: str = "fla_steps_every_length_2026_12_07") -> str:
    """bench_cp_state's rows (#56): one rank's share of one document, forward + backward, in each CP mode against no
    CP (time and peak memory; fla's steps also as a rank's time over no CP's, times cp), and the bytes a rank sends."""
    data = _load(name)[key]

    def cell(x: dict[str, Any] | None) -> str:
        if x is None:
            return "–"
        if "oom" in x:
            return "does not fit the card"
        return f"{x['ms']:.1f} ms, {x['peak_mib'] / 1024:.1f} GiB"

    def size(b: int) -> str:
        mib = b / 2**20
        return f"{mib:.0f} MiB" if mib < 1024 else f"{mib / 1024:.1f} GiB"

    rows = ["| one document | no CP | state passing, fla's steps, one rank | state passing, one pass, one rank | head "
            "all-to-all, one rank | bytes a rank sends: state passing / all-to-all |", "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        steps, whole = r["state_passing_steps_rank"], r.get("no_cp", {})
        ratio = f" ({steps['ms'] / whole['ms'] * r['cp']:.2f} / cp)" if "ms" in whole else ""
        sent = r["bytes_sent_per_rank"]
        rows.append(f"| {r['length'] // 1024}k tokens, cp = {r['cp']} | {cell(r.get('no_cp'))} | "
                    f"**{cell(steps)}**{ratio} | {cell(r.get('state_passing_rank'))} | {cell(r.get('head_split_rank'))} "
                    f"| {size(sent['state_passing'])} / {size(sent['head_split'])} |")
    return "\n".join(rows) + "\n\n" + f"<sub>from `benchmarks/results/{name}` ({key}; {data['device']})</sub>"


def plain(name: str) -> str:
    return {"both": "both switches", "det-both": "both, deterministic_mode", "fused": "`gdn_fused`",
            "flashqla": "`gdn_flashqla`"}.get(name, name)


TABLES: dict[str, Callable[[], str]] = {"step0": step0, "fast-layer": fast_layer, "fast-stack": fast_stack, "thd-modes": thd_modes,
                                        "train": train, "long": long_rows, "cost-layer": cost_layer,
                                        "cost-train": cost_train, "cp-state": cp_state}
# The file each table lives in (relative to the repository root).
HOME = {name: "docs/results.md" for name in TABLES} | {"cost-layer": "README.md", "cost-train": "README.md",
                                                        "cp-state": "docs/context-parallel.md"}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- numbers:{name}:start -->", f"<!-- numbers:{name}:end -->"


def blocks(text: str) -> dict[str, str]:
    """The tables between each pair of markers in ``text``."""
    found = {}
    for name in TABLES:
        start, end = markers(name)
        if start in text:
            found[name] = text[text.index(start) + len(start): text.index(end)].strip("\n")
    return found


def update(path: pathlib.Path) -> list[str]:
    """Render every table whose markers ``path`` holds, between them; returns the names written."""
    text = path.read_text()
    for name, render in TABLES.items():
        start, end = markers(name)
        if start in text:
            text = text[: text.index(start) + len(start)] + "\n" + render() + "\n" + text[text.index(end):]
    path.write_text(text)
    return list(blocks(text))


if __name__ == "__main__":
    for home in sorted(set(HOME.values())):
        print(f"{home}: rendered", ", ".join(update(ROOT / home)))
