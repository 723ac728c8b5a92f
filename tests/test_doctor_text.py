"""The doctor's default text (#54 item 4): the verdict first, what to fix first, what apply() would apply and what it
keeps out, in at most 25 lines; everything else behind --verbose; nobody else's warnings in it."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest

from gdn_compat import __main__ as doctor
from gdn_compat._probe import Layout
from gdn_compat.hazards import Finding
from tests.support.release import FACTS
from tests.test_prerequisites import without_fla

LIMIT = 25


def _text(data, verbose=False) -> list[str]:
    return doctor.render(data, verbose=verbose).splitlines()


@pytest.fixture(scope="module")
def data():
    return doctor.doctor()


def test_the_default_text_is_short_and_says_the_verdict_first(data):
    lines = _text(data)
    assert len(lines) <= LIMIT, "\n".join(lines)
    assert "verdict: " in lines[0] and ("verdict: OK" in lines[0]) == data["ok"]
    would = [p["name"] for p in data["patches"] if p["status"] == "would_apply"]
    if data["patches"]:
        [line] = [x for x in lines if x.startswith("apply() would apply: ")]
        assert line == "apply() would apply: " + (", ".join(would) or "nothing")
    assert len(_text(data, verbose=True)) > len(lines) + 20  # the probes and every reason are there with --verbose


def _without_fla(data):
    facts = without_fla()
    import gdn_compat
    from gdn_compat import hazards

    findings = [dataclasses.asdict(f) for f in hazards.check(facts)]
    return {**data, "facts": facts.as_dict(), "patches": [dataclasses.asdict(r) for r in gdn_compat.plan(facts)],
            "findings": findings, "ok": not hazards.failing(hazards.check(facts))}


@pytest.mark.skipif(FACTS.gdn not in (Layout.MODULE, Layout.PACKAGE), reason="no GatedDeltaNet: fla changes nothing")
def test_without_fla_the_fix_comes_before_the_plan_and_the_kept_out_patches_are_named(data):
    lines = _text(_without_fla(data))
    assert len(lines) <= LIMIT, "\n".join(lines)
    assert "problem(s) found" in lines[0]
    fix = next(i for i, x in enumerate(lines) if "fla-missing" in x)
    plan = next(i for i, x in enumerate(lines) if x.startswith("apply() would apply"))
    assert fix < plan and lines[fix + 1].strip().startswith("fix: pip install fla-core")
    assert any(x.startswith("NOT applied, though this release needs it: ") for x in lines[plan:])


def test_a_hazard_the_plan_takes_away_is_not_among_what_to_fix(data):
    would = [p["name"] for p in data["patches"] if p["status"] == "would_apply"]
    if not would:
        pytest.skip("nothing applies on this release")
    taken = Finding("warning", "test-taken-away", "a hazard a patch takes away", fixed_by=would[0])
    left = Finding("warning", "test-left", "a hazard nothing takes away")
    text = doctor.render({**data, "findings": [dataclasses.asdict(taken), dataclasses.asdict(left)]})
    assert "test-left" in text and "test-taken-away" not in text
    assert "test-taken-away" in doctor.render({**data, "findings": [dataclasses.asdict(taken)]}, verbose=True)


def test_third_party_warnings_and_log_lines_stay_out_of_the_doctor(capsys):
    """megatron-core warns as it is imported (no Transformer Engine, no Apex), torch logs "No CUDA runtime is found":
    the doctor's probe runs inside quiet_third_party (a fresh process: tests/test_readme.py)."""
    with doctor.quiet_third_party():
        warnings.warn("Transformer Engine and Apex are not installed", UserWarning, stacklevel=1)
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found")
        logging.getLogger("megatron.core.optimizer").warning("Falling back to Torch optimizers")
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    with pytest.warns(UserWarning):  # and only inside it
        warnings.warn("outside", UserWarning, stacklevel=1)
