"""The doctor: ``python -m gdn_compat [--json] [--key-head-dim N]``.

Prints the stack, each probe's finding, what ``apply()`` would decide for each patch, and the known
kernel-stack hazards; exits 1 when a finding is an error or a danger, else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gdn_compat", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--key-head-dim", type=int, default=None,
                        help="your model's GDN key head dim (decides the fla #640 miscompile rule)")
    parser.add_argument("--table-row", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import gdn_compat
    from gdn_compat import _table, hazards
    from gdn_compat._probe import probe

    facts = probe(init_cuda=True)  # its own process: creating a CUDA context here harms nobody
    if args.table_row:
        print(_table.row(facts))
        return 0
    plan = gdn_compat.plan(facts)
    findings = hazards.check(facts, key_head_dim=args.key_head_dim)
    bad = hazards.failing(findings)
    if args.json:
        print(json.dumps({
            "gdn_compat": gdn_compat.__version__,
            "facts": facts.as_dict(),
            "patches": [dataclasses.asdict(r) for r in plan],
            "findings": [dataclasses.asdict(f) for f in findings],
            "ok": not bad,
        }, indent=2, default=str))
        return 1 if bad else 0

    f = facts
    lines = [
        f"gdn_compat {gdn_compat.__version__} doctor",
        "stack:",
        f"  python {f.python}   torch {f.torch}   triton {f.triton}   GPU {f.cuda}",
        f"  megatron-core {f.megatron}   {f.megatron_path or f.megatron_error or ''}",
        f"  fla {f.fla or 'absent'}   {f.fla_path or f.fla_error or ''}"
        + (f"   tilelang {f.tilelang}" if f.tilelang else ""),
        "probes:",
        f"  GatedDeltaNet              {f.gdn}",
        f"  GDN packed sequences (THD) {f.gdn_thd}",
        f"  GDN context parallel       {f.gdn_cp}",
        f"  GDN unpacked conv          {f.gdn_conv}",
        f"  MTP _checkpointed_forward  {f.mtp}",
        f"  fla chunk_gated_delta_rule cu_seqlens={f.fla_rule_cu_seqlens} cu_seqlens_cpu={f.fla_rule_cu_seqlens_cpu}",
        f"  fla causal_conv1d          cu_seqlens={f.fla_conv_cu_seqlens} cu_seqlens_cpu={f.fla_conv_cu_seqlens_cpu}",
        "patches (what apply() would do):",
    ]
    for rec in plan:
        verdict = "APPLY" if rec.status == "applied" else "skip "
        lines.append(f"  {verdict} {rec.name:<17} {rec.target}")
        lines.append(f"        {rec.reason}")
    lines.append("findings:" if findings else "findings: none")
    lines += [f"  {item}" for item in findings]
    lines.append(f"verdict: {'OK' if not bad else f'{len(bad)} problem(s) found'}")
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
