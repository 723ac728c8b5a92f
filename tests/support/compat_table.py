"""The README's compatibility table, rendered from ``python -m gdn_compat --json`` (stdlib only).

``nox -s compat_table`` runs the doctor once per release and calls ``update_readme``; each release's
test session checks that its row in the README is current.
"""

from __future__ import annotations

import pathlib
from typing import Any

COLUMNS = ("gdn_thd", "gdn_thd_deterministic", "gdn_thd_graph_safe", "gdn_thd_cp_fused", "gdn_thd_zero_length",
           "gdn_flashqla", "gdn_fused", "gdn_cp_state",
           "gdn_thd_unpacked", "config_gdn_cp", "gdn_cp_comm_type", "gdn_out_norm_tp_grad", "gdn_backward_dw",
           "gdn_gate_fp32", "mtp_checkpoint_args", "mtp_packed_roll", "mtp_padding_mask")
HEADER = ("| megatron-core | GatedDeltaNet | THD in GDN | CP in GDN | MTP `_checkpointed_forward` | "
          + " | ".join(f"`{c}`" for c in COLUMNS) + " |\n|" + "---|" * (5 + len(COLUMNS)))
START, END = "<!-- compat-table:start -->", "<!-- compat-table:end -->"


def row(doctor: dict[str, Any]) -> str:
    f = doctor["facts"]
    status = {p["name"]: (p["status"], p["reason"]) for p in doctor["patches"]}

    def cell(name: str) -> str:
        state, reason = status.get(name, ("skipped", ""))
        if state == "would_apply":
            return "**applied**"
        if "opt-in, off by default" in reason:
            return "opt-in"
        if name == "gdn_flashqla" and "flash-qla is not installed" in reason:  # the table's machine has none
            return "opt-in (flash-qla)"
        if name == "gdn_thd_zero_length" and "zero-length entries right" in reason:  # the table's fla is >= 0.5.1
            return "with fla-core < 0.5.1"
        return "skipped"

    cells = [cell(c) for c in COLUMNS]
    cp = f["gdn_cp"] + (" (config refuses)" if f["config_refuses_gdn_cp"] else "")
    version = (f["megatron"] or {}).get("version", "none")
    return f"| {version} | {f['gdn']} | {f['gdn_thd']} | {cp} | {f['mtp']} | " + " | ".join(cells) + " |"


def render(rows: list[str]) -> str:
    return "\n".join([START, HEADER, *rows, END])


def update_readme(path: str | pathlib.Path, rows: list[str]) -> str:
    """Replace the marked table in the README at ``path``; returns the new table."""
    readme = pathlib.Path(path)
    text = readme.read_text()
    start, end = text.index(START), text.index(END) + len(END)
    table = render(rows)
    readme.write_text(text[:start] + table + text[end:])
    return table
