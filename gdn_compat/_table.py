"""The README's compatibility table: one row per megatron-core release, derived from its probes."""

from __future__ import annotations

import pathlib
import sys

from gdn_compat._probe import Facts

HEADER = ("| megatron-core | GatedDeltaNet | THD in GDN | CP in GDN | MTP `_checkpointed_forward` | `gdn_thd` "
          "(THD + CP) | `mtp_padding_mask` |\n|---|---|---|---|---|---|---|")
START, END = "<!-- compat-table:start -->", "<!-- compat-table:end -->"


def _short(decision: str | None) -> str:
    return "**applied**" if decision is None else "skipped"


def row(facts: Facts) -> str:
    from gdn_compat.patches import gdn_thd, mtp_padding_mask

    gdn = facts.gdn.split(" ", 1)[0]
    return (f"| {facts.megatron} | {gdn} | {facts.gdn_thd} | {facts.gdn_cp} | {facts.mtp} | "
            f"{_short(gdn_thd.decide(facts))} | {_short(mtp_padding_mask.decide(facts))} |")


def render(rows: list[str]) -> str:
    return "\n".join([START, HEADER, *rows, END])


def update_readme(path: str, rows: list[str]) -> str:
    """Replace the marked table in the README at ``path``; returns the new table."""
    readme = pathlib.Path(path)
    text = readme.read_text()
    start, end = text.index(START), text.index(END) + len(END)
    table = render(rows)
    readme.write_text(text[:start] + table + text[end:])
    return table


if __name__ == "__main__":  # nox -s compat_table: python -m gdn_compat._table README.md ROW...
    print(update_readme(sys.argv[1], sys.argv[2:]))
