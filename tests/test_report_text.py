"""What a user sees of an apply() (#54 item 2): ``print(gdn_compat.apply())``, the summary line, the warnings."""

from __future__ import annotations

import logging

import pytest

import gdn_compat
from gdn_compat._probe import FLA_FIX, Layout
from gdn_compat.hazards import Finding
from gdn_compat.patches import PATCHES
from tests.support.release import FACTS
from tests.test_prerequisites import needs_fla, without_fla


def test_printing_the_report_says_what_was_applied_in_its_first_line():
    with gdn_compat.applied() as report:
        first, *rest = str(report).splitlines()
    assert first == f"gdn_compat: {report.summary}"
    assert first.startswith(f"gdn_compat: {FACTS.release}: ")
    for name in report.applied:
        assert name in first
    if not report.applied:
        assert "nothing applied" in first
    assert all(line.startswith("  ") for line in rest), rest


@pytest.mark.skipif(FACTS.gdn not in (Layout.MODULE, Layout.PACKAGE), reason="no GatedDeltaNet: fla changes nothing")
def test_a_patch_kept_out_by_a_missing_fla_is_named_in_the_summary_and_its_fix_printed(monkeypatch, caplog):
    facts = without_fla()
    monkeypatch.setattr(gdn_compat, "probe", lambda **_: facts)
    monkeypatch.setattr(gdn_compat, "_said", set())  # the summary line is said once per process: say it here
    needed = {r.name for r in gdn_compat.plan(FACTS) if r.status == "would_apply"}
    with caplog.at_level(logging.INFO, logger="gdn_compat"), gdn_compat.applied() as report:
        text = str(report)
    kept = set(report.blocked)
    assert needed & needs_fla() <= kept, (kept, needed)
    assert not kept & {p.name for p in PATCHES if p.opt_in}  # the opt-in paths nobody asked for are not "kept out"
    assert "NOT applied " in report.summary, report.summary
    assert set(report.summary.split("NOT applied ", 1)[1].split(" (", 1)[0].split(", ")) == kept
    assert FLA_FIX in text and "fla-missing" in text
    assert report.summary in caplog.text  # the one INFO line says it too


def test_a_hazard_a_patch_took_away_is_not_warned_and_others_are(monkeypatch, caplog):
    with gdn_compat.applied() as report:
        names = report.applied
    if not names:
        pytest.skip("nothing applies on this release")
    fixed = Finding("warning", "test-fixed", "a hazard the applied patch takes away", fixed_by=names[0])
    open_ = Finding("warning", "test-open", "a hazard nothing takes away")
    monkeypatch.setattr(gdn_compat, "check", lambda facts, key_head_dim=None: [fixed, open_])
    with caplog.at_level(logging.WARNING, logger="gdn_compat"), gdn_compat.applied() as report:
        text = str(report)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [str(open_)]
    assert str(open_) in text and str(fixed) not in text
