"""The patch machinery against a fake release whose originals fail loudly if a patch did not land."""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import threading
import types

import pytest

from gdn_compat._probe import Facts
from gdn_compat._registry import ENV_DISABLE, MARKER, NOTSET, Patch, Registry, Target, switches_from

FACTS = Facts(python="3.12")
RELEASE_SOURCE = '''
class Base:
    def inherited(self):
        return "base"


class Target(Base):
    def method(self):
        raise AssertionError("patch failed: original method ran")

    @staticmethod
    def static():
        return "original static"
'''


@pytest.fixture
def release(monkeypatch):
    """A module that looks like a release: its own file, its own classes (fresh per test)."""
    mod = types.ModuleType("fake_release")
    mod.__file__ = "/site-packages/fake_release.py"
    exec(compile(RELEASE_SOURCE, mod.__file__, "exec"), mod.__dict__)
    monkeypatch.setitem(sys.modules, "fake_release", mod)
    return mod


def patch_for(attr="method", name="p1", needed=True, value="patched", fail=False, requires=()):
    def build(facts, original):
        if fail:
            raise RuntimeError("cannot build")

        def replacement(self=None):
            return value

        return replacement

    return Patch(name=name, target=Target("fake_release", "Target", attr),
                 decide=lambda facts: None if needed else "not needed here", build=build, summary="ok",
                 requires=requires)


def test_applied_patch_replaces_the_original_and_marks_it(release):
    reg = Registry((patch_for(),))
    [rec] = reg.apply(FACTS, {})
    assert (rec.status, rec.target) == ("applied", "fake_release.Target.method")
    assert release.Target().method() == "patched"
    assert getattr(release.Target.__dict__["method"], MARKER) == "p1"


def test_build_receives_the_facts_and_the_current_original(release):
    seen = []
    patch = dataclasses.replace(patch_for(), build=lambda facts, original: seen.append((facts, original)) or (
        lambda self: "patched"))
    original = release.Target.__dict__["method"]
    Registry((patch,)).apply(FACTS, {})
    assert seen == [(FACTS, original)]


def test_second_apply_reports_already_applied(release):
    original = release.Target.__dict__["method"]
    reg = Registry((patch_for(),))
    reg.apply(FACTS, {})
    [rec] = reg.apply(FACTS, {})
    assert (rec.status, rec.reason) == ("applied", "already applied")
    reg.revert()
    assert release.Target.__dict__["method"] is original


def test_plan_says_would_apply_and_changes_nothing(release):
    original = release.Target.__dict__["method"]
    [rec] = Registry((patch_for(),)).decide(FACTS, {})
    assert (rec.status, rec.reason) == ("would_apply", "ok")
    assert release.Target.__dict__["method"] is original


def test_revert_restores_identity_in_reverse_order_and_is_harmless_twice(release):
    T = release.Target
    orig_method, orig_static = T.__dict__["method"], T.__dict__["static"]
    reg = Registry((patch_for("method", "a"), patch_for("static", "b")))
    reg.apply(FACTS, {})
    records = reg.revert()
    assert [r.name for r in records] == ["b", "a"]
    assert all(r.status == "reverted" for r in records)
    assert T.__dict__["method"] is orig_method and T.__dict__["static"] is orig_static
    assert isinstance(T.__dict__["static"], staticmethod)
    assert reg.revert() == []
    with pytest.raises(AssertionError, match="patch failed"):
        T().method()


def test_revert_deletes_an_attribute_that_was_inherited(release):
    reg = Registry((patch_for("inherited"),))
    [rec] = reg.apply(FACTS, {})
    assert rec.status == "applied", rec
    assert release.Target().inherited() == "patched"
    assert reg.undo[0][2] is NOTSET
    reg.revert()
    assert "inherited" not in release.Target.__dict__ and release.Target().inherited() == "base"


def test_skipped_patch_leaves_the_target_alone_and_says_why(release):
    original = release.Target.__dict__["method"]
    [rec] = Registry((patch_for(needed=False),)).apply(FACTS, {})
    assert (rec.status, rec.reason) == ("skipped", "not needed here")
    assert release.Target.__dict__["method"] is original


def test_a_target_that_does_not_exist_is_skipped_with_the_patch_reason_and_never_forced(release):
    absent = Patch(name="p1", target=Target("fake_release", "", "gone"), decide=lambda facts: "release has no gone()",
                   build=lambda facts, original: lambda: "patched", summary="ok")
    for force in (frozenset(), frozenset({"p1"})):
        [rec] = Registry((absent,)).apply(FACTS, {}, force=force)
        assert rec.status == "skipped" and rec.reason == "release has no gone()", rec
        assert not hasattr(release, "gone")


def test_failing_patch_is_recorded_and_the_others_still_apply(release):
    original = release.Target.__dict__["method"]
    reg = Registry((patch_for("method", "broken", fail=True), patch_for("static", "fine")))
    broken, fine = reg.apply(FACTS, {})
    assert broken.status == "failed" and "cannot build" in broken.reason
    assert fine.status == "applied"
    assert release.Target.__dict__["method"] is original


def test_a_patch_whose_requirement_is_off_is_skipped_naming_it(release):
    reg = Registry((patch_for("method", "base"), patch_for("static", "child", requires=("base",))))
    base, child = reg.apply(FACTS, {"base": "disabled by apply(base=False)"})
    assert base.status == child.status == "skipped"
    assert child.reason == "needs base, which is skipped (disabled by apply(base=False))"
    assert release.Target.static() == "original static"


# -- someone else's replacement (issue 11 item 1) ----------------------------------------------


def test_a_target_replaced_before_apply_is_skipped_naming_what_is_there(release):
    def third_party_method(self):
        return "theirs"

    release.Target.method = third_party_method
    [rec] = Registry((patch_for(),)).apply(FACTS, {})
    assert rec.status == "skipped"
    assert "no longer the release's own" in rec.reason and "third_party_method" in rec.reason
    assert release.Target().method() == "theirs"


def test_a_wrapper_installed_before_apply_is_skipped_unless_forced(release):
    original = release.Target.__dict__["method"]

    @functools.wraps(original)  # copies __qualname__, __module__, __wrapped__: still not the release's
    def wrapper(self):
        return "wrapped " + str(original(self))

    release.Target.method = wrapper
    [rec] = Registry((patch_for(),)).apply(FACTS, {})
    assert rec.status == "skipped" and "force" in rec.reason
    reg = Registry((patch_for(),))
    [forced] = reg.apply(FACTS, {}, force=frozenset({"p1"}))
    assert forced.status == "applied" and "forced over" in forced.reason
    assert release.Target().method() == "patched"
    reg.revert()
    assert release.Target.__dict__["method"] is wrapper


def test_revert_leaves_a_later_third_party_wrapper_in_place(release, caplog):
    reg = Registry((patch_for(),))
    reg.apply(FACTS, {})
    ours = release.Target.__dict__["method"]

    def their_wrapper(self):
        return "theirs around " + ours(self)

    release.Target.method = their_wrapper
    with caplog.at_level(logging.WARNING, logger="gdn_compat"):
        [rec] = reg.revert()
    assert rec.status == "left_in_place"
    assert rec.reason.startswith("replaced after apply by ") and "their_wrapper" in rec.reason
    assert release.Target.__dict__["method"] is their_wrapper
    assert release.Target().method() == "theirs around patched"
    assert any("left_in_place" in r.getMessage() for r in caplog.records)


# -- switches and logging ----------------------------------------------------------------------


def test_disabled_patch_is_skipped_with_the_switch_named(release):
    off = switches_from(("p1",), {"p1": False})
    [rec] = Registry((patch_for(),)).apply(FACTS, off)
    assert (rec.status, rec.reason) == ("skipped", "disabled by apply(p1=False)")


def test_env_var_disables_by_name(monkeypatch):
    monkeypatch.setenv(ENV_DISABLE, "gdn_thd, mtp_padding_mask")
    assert switches_from(("gdn_thd", "mtp_padding_mask", "x"), {}) == {
        "gdn_thd": f"disabled by {ENV_DISABLE}=gdn_thd, mtp_padding_mask",
        "mtp_padding_mask": f"disabled by {ENV_DISABLE}=gdn_thd, mtp_padding_mask",
    }


def test_unknown_switches_are_errors_naming_the_value(monkeypatch):
    with pytest.raises(TypeError, match=r"\['gdn_tdh'\]"):
        switches_from(("gdn_thd",), {"gdn_tdh": False})
    with pytest.raises(TypeError, match="expects True or False, got 'no'"):
        switches_from(("gdn_thd",), {"gdn_thd": "no"})
    monkeypatch.setenv(ENV_DISABLE, "gdn_thd,typo")
    with pytest.raises(ValueError, match=r"\['typo'\]"):
        switches_from(("gdn_thd",), {})


def test_each_decision_is_logged_once_with_the_qualified_target(release, caplog):
    reg = Registry((patch_for(),))
    with caplog.at_level(logging.DEBUG, logger="gdn_compat"):
        reg.apply(FACTS, {})
        reg.revert()
        reg.apply(FACTS, {})
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("p1 applied fake_release.Target.method: ok") == 1
    assert lines.count("p1 reverted fake_release.Target.method: original restored") == 1


def test_concurrent_apply_patches_once(release):
    reg = Registry((patch_for(),))
    threads = [threading.Thread(target=reg.apply, args=(FACTS, {})) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg.undo) == 1
