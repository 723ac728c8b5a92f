"""The doctor: ``python -m gdn_compat [--verbose] [--json] [--key-head-dim N]``.

By default: the verdict, what to fix first, what ``apply()`` would apply and what it could not, in about 20 lines;
``--verbose`` adds the stack's paths, every probe, every patch's reason and every finding; ``--json`` is all of it as
data. Exit codes: 0 nothing wrong, 1 a finding is an error or a danger, 2 a usage error (a bad argument or a bad
``GDN_COMPAT_DISABLE``), reported as a finding too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


def doctor(key_head_dim: int | None = None) -> dict[str, Any]:
    """Everything the doctor reports, as plain data (the ``--json`` output)."""
    import gdn_compat
    from gdn_compat import hazards

    try:  # GDN_COMPAT_AUTO would apply as the probe imports megatron-core: the doctor looks at the release as it is
        import _gdn_compat_auto

        _gdn_compat_auto.disarm()
    except ImportError:
        pass
    with quiet_third_party():
        facts = gdn_compat.probe(init_cuda=True)  # its own process: creating a CUDA context harms nobody
    findings = hazards.check(facts, key_head_dim=key_head_dim)
    try:
        plan = [dataclasses.asdict(r) for r in gdn_compat.plan(facts)]
        usage = None
    except (TypeError, ValueError) as exc:
        plan = []
        usage = hazards.Finding("error", "usage", str(exc), fix="correct the patch names (see `patches` in --help)")
        findings.insert(0, usage)
    return {
        "gdn_compat": gdn_compat.__version__,
        "facts": facts.as_dict(),
        "flashqla": flashqla_status(facts),
        "auto": auto_status(),
        "patches": plan,
        "findings": [dataclasses.asdict(f) for f in findings],
        "ok": not hazards.failing(findings),
        "exit": EXIT_USAGE if usage else (EXIT_PROBLEM if hazards.failing(findings) else EXIT_OK),
    }


@contextlib.contextmanager
def quiet_third_party() -> Iterator[None]:
    """What megatron-core, fla and torch say while the probe imports them (UserWarnings about Transformer Engine, Apex,
    absl; torch's "No CUDA runtime is found") is theirs, not a finding: the doctor, a process of its own, keeps it off
    its output. The library itself never silences anyone's warnings."""
    loggers = [logging.getLogger(n) for n in ("torch.utils.cpp_extension", "megatron", "fla")]
    levels = [x.level for x in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in loggers:
            x.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for x, level in zip(loggers, levels):
                x.setLevel(level)


def auto_status() -> dict[str, Any]:
    """GDN_COMPAT_AUTO in this environment: the variable, whether it means on, where gdn_compat_auto.pth is (site reads
    it at interpreter start), and so whether a new process of this environment would apply gdn_compat when it
    imports megatron-core."""
    import os
    import site

    value = os.environ.get("GDN_COMPAT_AUTO")
    on = (value or "").strip().lower() in ("1", "true", "yes", "on")
    folders = [*site.getsitepackages(), site.getusersitepackages()] if hasattr(site, "getsitepackages") else []
    pth = next((os.path.join(f, "gdn_compat_auto.pth") for f in folders
                if os.path.isfile(os.path.join(f, "gdn_compat_auto.pth"))), None)
    return {"variable": value, "on": on, "pth": pth, "fires": bool(on and pth)}


def _auto_line(a: dict[str, Any]) -> str:
    where = f"gdn_compat_auto.pth at {a['pth']}" if a["pth"] else ("no gdn_compat_auto.pth in this environment's "
                                                                   "site-packages (pip install . or pip install -e .)")
    if a["variable"] is None:
        return f"unset; {where}"
    verdict = ("a new process applies gdn_compat when it imports megatron-core" if a["fires"] else
               "no process applies it by itself" + ("" if a["on"] else " (the value is not on: 1, true, yes, on)"))
    return f"{a['variable']!r}; {where}; {verdict}"


def flashqla_status(facts: Any) -> str:
    """Whether FlashQLA (gdn_flashqla's delta rule) is present and usable on this machine's GPU; imports it only
    when everything else says yes (the doctor runs in its own process)."""
    from gdn_compat.patches.gdn_flashqla import flashqla_skip
    from gdn_compat.patches.gdn_thd.fast import FLASHQLA_GPUS

    why = flashqla_skip(facts)
    if why:
        return f"not usable: {why}"
    if facts.gpu is None:
        return f"{facts.flashqla} present; GPU not checked ({facts.notes.get('gpu', 'no GPU')})"
    if tuple(facts.gpu.capability) not in FLASHQLA_GPUS:
        return f"{facts.flashqla} present, not usable on {facts.gpu}: its kernels with a backward are for sm90/sm100/sm103"
    if not facts.tilelang:
        return f"{facts.flashqla} present, not usable: tilelang is not installed"
    try:
        import flash_qla  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the finding is the reason
        return f"{facts.flashqla} present, fails to import on {facts.gpu}: {type(exc).__name__}: {str(exc)[:160]}"
    return (f"{facts.flashqla} usable on {facts.gpu} (atomic-free source: {facts.flashqla_atomic_free}; chunk metadata "
            f"from the offsets, so CUDA-graph capture: {facts.flashqla_metadata})")


def _fused_status(f: dict[str, Any]) -> str:
    if not f["triton"]:
        return "not usable: Triton is not installed"
    import os

    from gdn_compat.fused import triton_checked

    checked = triton_checked(f["triton"])
    if f["gpu"]:
        return f"usable on this GPU; {checked}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return f"CPU tensors through Triton's interpreter (TRITON_INTERPRET=1; slow, for tests); {checked}"
    return f"needs a CUDA GPU (none here); {checked}"


_DETERMINISTIC = {"no": "refused (asserts)", "yes": "runs"}


def _graph_safe(v: dict[str, Any]) -> bool:
    from gdn_compat._probe import Accepts, Varlen

    return Varlen(**{k: Accepts(x) for k, x in v.items()}).graph_safe


def _failing(data: dict[str, Any]) -> int:
    return sum(1 for item in data["findings"] if item["severity"] in ("error", "danger"))


def _to_fix(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Findings a user acts on: errors, dangers and warnings, less those a patch apply() would apply takes away."""
    coming = {p["name"] for p in data["patches"] if p["status"] in ("would_apply", "applied")}
    return [x for x in data["findings"] if x["severity"] != "info" and x.get("fixed_by", "") not in coming]


def _kept_out(data: dict[str, Any]) -> dict[str, list[str]]:
    """reason -> the patches this release needs that it keeps out (an opt-in patch only where GDN_COMPAT_ENABLE asks
    for it)."""
    import os

    from gdn_compat._registry import ENV_ENABLE, by_reason, kept_out
    from gdn_compat.patches import PATCHES

    asked = {n.strip() for n in os.environ.get(ENV_ENABLE, "").split(",")}
    quiet = {p.name for p in PATCHES if p.opt_in} - asked
    return by_reason([(r["name"], r["reason"]) for r in data["patches"]
                      if r["name"] not in quiet and kept_out(r["status"], r["reason"])])


def _stack_line(f: dict[str, Any]) -> str:
    mc, fla, gpu = f["megatron"] or {}, f["fla"] or {}, f["gpu"]
    parts = [f"megatron-core {mc['version']}" if mc else "megatron-core: not installed",
             f"torch {f['torch']}" + (f" (Triton {f['triton']})" if f["triton"] else "") if f["torch"] else
             "torch: not importable",
             f"{fla['name']} {fla['version']}" if fla else "fla-core: not installed"]
    if f["flashqla"]:
        parts.append(f"{f['flashqla']['name']} {f['flashqla']['version']}")
    parts.append(f"GPU sm_{gpu['capability'][0]}{gpu['capability'][1]} {gpu['name']}" if gpu else
                 f"no GPU seen ({f['notes'].get('gpu', '?')})")
    return "stack: " + ", ".join(parts)


def summary(data: dict[str, Any]) -> list[str]:
    """The default report: the verdict, what to fix first, what apply() would apply and what it keeps out."""
    from gdn_compat.patches import PATCHES

    f, bad = data["facts"], _failing(data)
    lines = [f"gdn_compat {data['gdn_compat']} doctor -- verdict: "
             + ("OK" if not bad else f"{bad} problem(s) found: fix them first"), _stack_line(f)]
    fix = _to_fix(data)
    if fix:
        lines.append("fix first:" if bad else "check:")
        for item in fix:
            lines.append(f"  [{item['severity']}] {item['code']}: {item['message']}")
            if item["fix"]:
                lines.append(f"      fix: {item['fix']}")
    plan = data["patches"]
    would = [p["name"] for p in plan if p["status"] in ("would_apply", "applied")]
    if plan:
        lines.append(f"apply() would apply: {', '.join(would) if would else 'nothing'}")
    for reason, names in _kept_out(data).items():
        lines.append(f"NOT applied, though this release needs it: {', '.join(names)}")
        lines.append(f"      why: {reason}")
    opt_in = {p.name for p in PATCHES if p.opt_in}
    can = [p["name"] for p in plan if p["name"] in opt_in and "opt-in, off by default" in p["reason"]]
    if can:
        lines.append(f"opt-in, off: {', '.join(can)} (apply(NAME=True) or GDN_COMPAT_ENABLE=NAME turns one on)")
    rest = len(plan) - len(would) - len(can) - sum(map(len, _kept_out(data).values()))
    if plan:
        lines.append(f"not needed or not available here: {rest} more (--verbose says why for each)")
    if data["auto"]["variable"] is not None:
        lines.append(f"GDN_COMPAT_AUTO: {_auto_line(data['auto'])}")
    if f["gpu"] is None and f["megatron"]:
        lines.append("no GPU seen: run it on a GPU node, in your workers' environment, for the GPU kernel rules")
    lines.append("more: python -m gdn_compat --verbose (every probe, reason and note); --json (the same as data)")
    return lines


def render(data: dict[str, Any], verbose: bool = False) -> str:
    """The text report: ``summary`` first; with ``verbose`` every probe, patch reason and finding after it."""
    lines = summary(data)
    if verbose:
        lines += ["", *details(data)]
    return "\n".join(lines)


def details(data: dict[str, Any]) -> list[str]:
    f = data["facts"]
    mc, fla = f["megatron"] or {}, f["fla"] or {}
    v = f["fla_varlen"]
    lines = [
        "stack:",
        f"  python {f['python']}   torch {f['torch']}   triton {f['triton']}",
        f"  megatron-core {mc.get('version', 'absent')}   {mc.get('path') or ''}",
        f"  fla {fla.get('name', 'absent')} {fla.get('version', '')}   {fla.get('path') or f['fla_error'] or ''}"
        + (f"   tilelang {f['tilelang']}" if f["tilelang"] else ""),
        "probes:",
        f"  GatedDeltaNet              {f['gdn']} {f['gdn_file'] or ''}",
        f"  GDN packed sequences (THD) {f['gdn_thd']}"
        + (f"   in deterministic mode: {_DETERMINISTIC.get(f['gdn_thd_deterministic'], f['gdn_thd_deterministic'])}"
           if f["gdn_thd"] == "native" else ""),
        f"  GDN context parallel       {f['gdn_cp']}   config refuses it: {f['config_refuses_gdn_cp']}",
        f"  GDN __init__ cp_comm_type  {f['gdn_init_cp_comm_type']}",
        f"  GDN unpacked conv          {f['gdn_conv']}",
        f"  MTP _checkpointed_forward  {f['mtp']}",
        f"  MTP roll of a packed batch {f['mtp_roll']}",
        f"  fla varlen (packed) kernels   delta rule cu_seqlens={v['rule']} (cu_seqlens_cpu={v['rule_cpu']}), "
        f"conv cu_seqlens={v['conv']} (cu_seqlens_cpu={v['conv_cpu']})",
        "  fla takes chunk indices built on the GPU (CUDA-graph capture of packed GDN): "
        + ("yes" if _graph_safe(v) else f"no (delta rule {v['rule_chunks']}, its forward/backward {v['rule_inner']}, "
                                        f"conv {v['conv_chunks']})"),
        f"  fla kernels atomic-free    {f['fla_atomic_free']}   {f['notes'].get('fla_atomic_free', '')}"
        + ("   (deterministic THD runs them)" if f["fla_atomic_free"] == "yes" else ""),
    ]
    if f["gdn_thd"] == "native":  # only the release's own packed forward hands fla offsets with empty entries
        lines.append(f"  fla chunk table right for zero-length offsets entries: {f['fla_zero_length']}"
                     + ("   (the release's own forward computes garbage for such packs; gdn_thd_zero_length takes them)"
                        if f["fla_zero_length"] == "no" else ""))
    lines += [
        f"  GDN_COMPAT_AUTO            {_auto_line(data['auto'])}",
        f"  FlashQLA (gdn_flashqla)    {data['flashqla']}",
        f"  fused kernels (gdn_fused)  {_fused_status(f)}",
        f"  GDN context parallel modes {_cp_modes(f, data['patches'])}",
        f"  fla routes to FlashQLA     {f['fla_flashqla_backend']}" + ("   (off: FLA_FLASH_QLA=0)" if f["fla_flashqla_off"] else ""),
    ]
    lines += [f"  note {k}: {why}" for k, why in f["notes"].items()
              if k not in ("fla_atomic_free",) and (k != "fla_zero_length" or f["gdn_thd"] == "native")]
    lines.append("patches (what apply() would do):")
    for rec in data["patches"]:
        lines.append(f"  {'APPLY' if rec['status'] == 'would_apply' else 'skip '} {rec['name']:<21} {rec['target']}")
        lines.append(f"        {rec['reason']}")
    lines.append("findings:" if data["findings"] else "findings: none")
    for item in data["findings"]:
        lines.append(f"  [{item['severity']}] {item['code']}: {item['message']}"
                     + (f" Fix: {item['fix']}" if item["fix"] else "") + (f" ({item['source']})" if item["source"] else "")
                     + (f" Taken away by {item['fixed_by']} where it applies." if item.get("fixed_by") else ""))
    return lines


def _cp_modes(f: dict, patches: list[dict]) -> str:
    """Which GDN context-parallel modes this stack runs: the head all-to-all (the release's on 0.18/0.19, gdn_thd's on
    0.16/0.17) and passing the state between ranks (gdn_cp_state)."""
    status = {p["name"]: p for p in patches}
    thd = status.get("gdn_thd", {})
    heads = ("the release's" if f["gdn_cp"] == "native" else "gdn_thd's" if thd.get("status") == "would_apply"
             else "none")
    state = status.get("gdn_cp_state", {})
    if state.get("status") == "would_apply":
        passing = "on"
    elif "opt-in, off by default" in state.get("reason", ""):
        passing = "available, apply(gdn_cp_state=True)"
    else:
        return f"head all-to-all: {heads}; state passing (gdn_cp_state): not here ({state.get('reason', 'unknown')})"
    steps = f["fla_varlen"].get("state_steps")
    how = ("fla's chunk steps, the transitions apart from the rule" if steps == "yes" else
           f"the rule once K + V wide (fla-core 0.4.2's chunk steps: {steps}, note fla_state_steps)")
    return f"head all-to-all: {heads}; state passing (gdn_cp_state): {passing}, on the GPU {how}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gdn_compat", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="after the verdict, every probe, every patch's reason and every finding")
    parser.add_argument("--key-head-dim", type=int, default=None,
                        help="your model's GDN key head dim (decides the fla #640 miscompile rule)")
    args = parser.parse_args(argv)  # argparse exits 2 on a bad argument, as EXIT_USAGE
    data = doctor(args.key_head_dim)
    print(json.dumps(data, indent=2, default=str) if args.json else render(data, verbose=args.verbose))
    return int(data["exit"])


if __name__ == "__main__":
    sys.exit(main())
