"""The public API on the installed release: apply/revert/report/applied/plan, the doctor, the README table."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

import gdn_compat
from gdn_compat.__main__ import EXIT_USAGE, doctor
from gdn_compat._registry import NOTSET
from gdn_compat.patches import PATCHES
from tests.support import compat_table
from tests.support.release import FACTS, MEGATRON

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _targets():
    out = {}
    for patch in PATCHES:
        try:
            owner, obj = patch.target.resolve()
        except Exception:  # noqa: BLE001 - release without this module
            continue
        out[patch.name] = (owner, patch.target.attr, obj)
    return out


def test_apply_twice_then_revert_restores_every_original():
    before = _targets()
    first = gdn_compat.apply()
    second = gdn_compat.apply()
    for rec in second:
        if first[rec.name].status == "applied":
            assert rec.reason == "already applied"
    reverted = gdn_compat.revert()
    assert {r.name for r in reverted if r.status == "reverted"} == set(first.applied)
    for owner, attr, obj in before.values():
        assert owner.__dict__.get(attr, NOTSET) is obj
    assert gdn_compat.revert().records == reverted.records  # harmless twice


IMPORT_ONLY = ("import importlib, gdn_compat\nfrom gdn_compat.patches import PATCHES\nfrom gdn_compat._registry import MARKER\n"
               "for p in PATCHES:\n"
               "    try: owner, obj = p.target.resolve()\n"
               "    except Exception: continue\n"
               "    assert not hasattr(obj, MARKER), p.name\n"
               "print('unchanged')")


@pytest.fixture(scope="module")
def fresh_process():
    """The checks that need a fresh interpreter, in one (it spends ~8 s of CPU importing torch and megatron-core): first
    that importing gdn_compat changed nothing (its line), then the doctor's JSON (the rest of its output)."""
    logged = "import atexit\nfrom tests.support import suite_records\natexit.register(suite_records.log_imports)\n"
    doctor = "import sys, runpy\nsys.argv = ['gdn_compat', '--json']\nrunpy.run_module('gdn_compat', run_name='__main__')"
    # it logs its imports for the suite records
    proc = subprocess.run([sys.executable, "-c", logged + IMPORT_ONLY + "\n" + doctor], capture_output=True, text=True,
                          cwd=ROOT)
    first, _, rest = proc.stdout.partition("\n")
    return {"import": first, "doctor": (proc.returncode, rest, proc.stderr)}


@pytest.mark.heavy
def test_importing_changes_nothing(fresh_process):
    assert fresh_process["import"] == "unchanged", fresh_process["doctor"][2][-2000:]


def test_applied_context_reverts_what_it_applied():
    with gdn_compat.applied() as report:
        names = report.applied
    assert all(gdn_compat.report()[n].status == "reverted" for n in names)


def test_plan_says_would_apply_where_apply_says_applied():
    planned = {r.name: r.status for r in gdn_compat.plan()}
    assert "applied" not in planned.values()
    with gdn_compat.applied() as report:
        done = {r.name: r.status for r in report}
        again = {r.name: (r.status, r.reason) for r in gdn_compat.plan()}
    assert done == {n: "applied" if s == "would_apply" else s for n, s in planned.items()}
    assert all(again[n] == ("applied", "already applied") for n, s in done.items() if s == "applied")


def test_after_apply_the_plan_keeps_every_skip_reason():
    """Two patches may share a target (0.15-0.17: mtp_checkpoint_args and mtp_padding_mask); our own
    replacement of it must not turn the other's reason into 'someone else replaced it'."""
    before = {r.name: r for r in gdn_compat.plan()}
    with gdn_compat.applied():
        after = {r.name: r for r in gdn_compat.plan()}
    for name, rec in before.items():
        expected = ("applied", "already applied") if rec.status == "would_apply" else (rec.status, rec.reason)
        assert (after[name].status, after[name].reason) == expected, name


@pytest.mark.heavy
def test_doctor_json_is_machine_readable_and_agrees_with_the_plan(fresh_process):
    returncode, stdout, _ = fresh_process["doctor"]
    data = json.loads(stdout)
    assert returncode == (0 if data["ok"] else 1)
    assert {p["name"]: p["status"] for p in data["patches"]} == {r.name: r.status for r in gdn_compat.plan()}
    assert data["facts"]["megatron"]["version"] == MEGATRON


@pytest.mark.parametrize("flag", ["", "--json"])
def test_doctor_reports_a_bad_disable_variable_as_a_usage_finding(flag, monkeypatch, capsys):
    from gdn_compat.__main__ import main

    monkeypatch.setenv("GDN_COMPAT_DISABLE", "bogus")  # in-process: a traceback would fail the test
    code = main(list(filter(None, [flag])))
    out = capsys.readouterr().out
    assert code == EXIT_USAGE
    if flag:
        data = json.loads(out)
        [usage] = [f for f in data["findings"] if f["code"] == "usage"]
        assert "bogus" in usage["message"] and data["ok"] is False
    else:
        assert "usage: GDN_COMPAT_DISABLE='bogus' names unknown patch(es) ['bogus']" in out


def test_doctor_text_names_every_patch_and_a_verdict(capsys):
    from gdn_compat.__main__ import main

    code = main(["--verbose"])
    text = capsys.readouterr().out
    for patch in PATCHES:
        assert patch.name in text and str(patch.target) in text
    assert ("verdict: OK" in text.splitlines()[0]) == (code == 0)


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
    if FACTS.megatron is None:
        pytest.skip("no megatron-core installed")
    if "megatron" in FACTS.notes:  # a source tree ahead of the installed release (nox -s source): no README row
        pytest.skip(f"megatron.core is a source tree, not a release: {FACTS.notes['megatron']}")
    import torch._dynamo

    readme = (ROOT / "README.md").read_text()
    with torch._dynamo.config.patch(disable=False):  # as users run it (the CPU suite turns dynamo off: gates eager)
        row = compat_table.row(doctor())
    assert row in readme, f"README compatibility table is stale; regenerate with `nox -s compat_table`. Expected row:\n{row}"


def test_readme_holds_no_captured_process_output_and_no_workplace_paths():
    readme = (ROOT / "README.md").read_text()
    junk = [line for line in readme.splitlines()
            if "site-packages/" in line or "Warning:" in line or "../shared" in line or "/root/" in line]
    assert junk == [], junk[:3]


def test_switching_off_an_applied_patch_warns_that_it_stays(caplog, monkeypatch):
    import logging

    names = [r.name for r in gdn_compat.plan() if r.status == "would_apply"]
    if not names:
        pytest.skip("nothing applies on this release")
    with gdn_compat.applied():
        with caplog.at_level(logging.WARNING, logger="gdn_compat"):
            gdn_compat.apply(**{names[0]: False})
        assert f"{names[0]} is already applied in this process; disabled by apply({names[0]}=False) does not undo it" \
            in caplog.text
        assert gdn_compat.report()[names[0]].status == "applied"


def test_gdn_compat_disable_wins_over_enable_and_over_a_keyword(monkeypatch):
    opt_in = [r.name for r in gdn_compat.plan() if "opt-in, off by default" in r.reason]
    if not opt_in:
        pytest.skip("no opt-in patch can apply on this release")
    monkeypatch.setenv("GDN_COMPAT_ENABLE", opt_in[0])
    monkeypatch.setenv("GDN_COMPAT_DISABLE", opt_in[0])
    for plan in (gdn_compat.plan(), gdn_compat.plan(**{opt_in[0]: True})):
        [rec] = [r for r in plan if r.name == opt_in[0]]
        assert rec.status == "skipped" and "GDN_COMPAT_DISABLE" in rec.reason
