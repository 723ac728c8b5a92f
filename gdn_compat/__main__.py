"""The doctor: ``python -m gdn_compat [--json] [--key-head-dim N]``.

Prints the stack, each probe's finding, what ``apply()`` would decide for each patch, and the known
kernel-stack hazards. Exit codes: 0 nothing wrong, 1 a finding is an error or a danger, 2 a usage
error (a bad argument or a bad ``GDN_COMPAT_DISABLE``), reported as a finding too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
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


def render(data: dict[str, Any]) -> str:
    f = data["facts"]
    mc, fla, gpu = f["megatron"] or {}, f["fla"] or {}, f["gpu"]
    v = f["fla_varlen"]
    lines = [
        f"gdn_compat {data['gdn_compat']} doctor",
        "stack:",
        f"  python {f['python']}   torch {f['torch']}   triton {f['triton']}   GPU "
        + (f"sm_{gpu['capability'][0]}{gpu['capability'][1]} {gpu['name']}" if gpu else f["notes"].get("gpu", "?")),
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
        f"  fla chunk_gated_delta_rule cu_seqlens={v['rule']} cu_seqlens_cpu={v['rule_cpu']}",
        f"  fla causal_conv1d          cu_seqlens={v['conv']} cu_seqlens_cpu={v['conv_cpu']}",
        f"  fla takes chunk indices    rule={v['rule_chunks']} rule fwd/bwd={v['rule_inner']} conv={v['conv_chunks']}"
        + ("   (packed GDN can be captured in a CUDA graph)" if _graph_safe(v) else "   (no CUDA-graph capture of packed GDN)"),
        f"  fla kernels atomic-free    {f['fla_atomic_free']}   {f['notes'].get('fla_atomic_free', '')}"
        + ("   (deterministic THD runs them)" if f["fla_atomic_free"] == "yes" else ""),
    ]
    lines += [
        f"  fla chunk indices, empty   {f['fla_zero_length']}   (offsets with zero-length entries; no: wrong in "
        f"0.18/0.19's own forward, gdn_thd_zero_length takes those calls)",
        f"  GDN_COMPAT_AUTO            {_auto_line(data['auto'])}",
        f"  FlashQLA (gdn_flashqla)    {data['flashqla']}",
        f"  fused kernels (gdn_fused)  {_fused_status(f)}",
        f"  fla routes to FlashQLA     {f['fla_flashqla_backend']}" + ("   (off: FLA_FLASH_QLA=0)" if f["fla_flashqla_off"] else ""),
    ]
    lines += [f"  note {k}: {why}" for k, why in f["notes"].items() if k not in ("fla_atomic_free",)]
    lines.append("patches (what apply() would do):")
    for rec in data["patches"]:
        lines.append(f"  {'APPLY' if rec['status'] == 'would_apply' else 'skip '} {rec['name']:<21} {rec['target']}")
        lines.append(f"        {rec['reason']}")
    lines.append("findings:" if data["findings"] else "findings: none")
    for item in data["findings"]:
        lines.append(f"  [{item['severity']}] {item['code']}: {item['message']}"
                     + (f" Fix: {item['fix']}" if item["fix"] else "") + (f" ({item['source']})" if item["source"] else ""))
    bad = sum(1 for item in data["findings"] if item["severity"] in ("error", "danger"))
    lines.append(f"verdict: {'OK' if not bad else f'{bad} problem(s) found'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gdn_compat", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--key-head-dim", type=int, default=None,
                        help="your model's GDN key head dim (decides the fla #640 miscompile rule)")
    args = parser.parse_args(argv)  # argparse exits 2 on a bad argument, as EXIT_USAGE
    data = doctor(args.key_head_dim)
    print(json.dumps(data, indent=2, default=str) if args.json else render(data))
    return int(data["exit"])


if __name__ == "__main__":
    sys.exit(main())
