"""The public API on the installed release: apply/revert/report/applied, doctor and README table."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

import gdn_compat
from gdn_compat import _table
from gdn_compat.patches import PATCHES

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_apply_twice_then_revert_restores_every_original():
    import importlib

    before = {}
    for patch in PATCHES:
        module, cls, attr = patch.target.rsplit(".", 2)
        try:
            owner = getattr(importlib.import_module(module), cls)
        except Exception:  # noqa: BLE001 - release without this module
            continue
        before[patch.name] = (owner, attr, owner.__dict__.get(attr))
    first = gdn_compat.apply()
    second = gdn_compat.apply()
    for rec in second:
        if first[rec.name].status == "applied":
            assert rec.reason == "already applied"
    reverted = gdn_compat.revert()
    assert {r.name for r in reverted if r.status == "reverted"} == set(first.applied)
    for owner, attr, obj in before.values():
        assert owner.__dict__.get(attr) is obj
    assert gdn_compat.revert().records == reverted.records  # harmless twice


def test_applied_context_reverts_what_it_applied():
    with gdn_compat.applied() as report:
        names = report.applied
    assert all(gdn_compat.report()[n].status == "reverted" for n in names)


def test_plan_agrees_with_apply():
    planned = {r.name: r.status for r in gdn_compat.plan()}
    with gdn_compat.applied() as report:
        assert {r.name: r.status for r in report} == planned


def test_doctor_json_is_machine_readable_and_agrees_with_the_plan():
    out = subprocess.run([sys.executable, "-m", "gdn_compat", "--json"], capture_output=True, text=True, cwd=ROOT)
    data = json.loads(out.stdout)
    assert out.returncode == (0 if data["ok"] else 1)
    assert {p["name"]: p["status"] for p in data["patches"]} == {r.name: r.status for r in gdn_compat.plan()}
    assert data["facts"]["megatron"] == gdn_compat.facts.megatron


def test_doctor_text_names_every_patch_and_a_verdict(capsys):
    from gdn_compat.__main__ import main

    code = main([])
    text = capsys.readouterr().out
    for patch in PATCHES:
        assert patch.name in text and patch.target in text
    assert ("verdict: OK" in text) == (code == 0)


def test_apply_warns_once_per_hazard_and_reports_it(monkeypatch, caplog):
    from gdn_compat.hazards import Finding

    danger = Finding("danger", "test-hazard", "a stack that computes wrong gradients")
    monkeypatch.setattr(gdn_compat, "check", lambda facts, key_head_dim=None: [danger])
    with caplog.at_level("WARNING", logger="gdn_compat"):
        with gdn_compat.applied() as first:
            gdn_compat.apply()
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [str(danger)]
    assert first.findings == (danger,)


def test_readme_compatibility_row_for_this_release_is_current():
    if gdn_compat.facts.megatron is None:
        pytest.skip("no megatron-core installed")
    readme = (ROOT / "README.md").read_text()
    row = _table.row(gdn_compat.facts)
    assert row in readme, f"README compatibility table is stale; regenerate with `nox -s compat_table`. Expected row:\n{row}"


def test_readme_holds_no_captured_process_output():
    """`nox -s compat_table` once pasted import-time stderr (warnings) above the table."""
    readme = (ROOT / "README.md").read_text()
    junk = [line for line in readme.splitlines() if "site-packages/" in line or "Warning:" in line]
    assert junk == [], junk[:3]
