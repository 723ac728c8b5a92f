"""The patch machinery against fakes whose originals fail loudly if a patch did not land."""

from __future__ import annotations

import logging
import threading

import pytest

from gdn_compat._probe import Facts
from gdn_compat._registry import ENV_DISABLE, MARKER, NOTSET, Patch, Registry, enabled_from

FACTS = Facts(python="3.12")


class Base:
    def inherited(self):
        return "base"


def make_target():
    class Target(Base):
        def method(self):
            raise AssertionError("patch failed: original method ran")

        @staticmethod
        def static():
            return "original static"

    return Target


def patch_for(owner, attr="method", name="p1", needed=True, value="patched", fail=False):
    def build():
        if fail:
            raise RuntimeError("cannot build")

        def replacement(self):
            return value

        return [(owner, attr, replacement)]

    return Patch(name=name, target=f"fake.{owner.__name__}.{attr}",
                 decide=lambda facts: None if needed else "not needed here", build=build, summary="ok")


def test_applied_patch_replaces_the_original_and_marks_it():
    T = make_target()
    reg = Registry((patch_for(T),))
    [rec] = reg.apply(FACTS, {})
    assert rec.status == "applied"
    assert T().method() == "patched"
    assert getattr(T.__dict__["method"], MARKER) == "p1"


def test_second_apply_reports_already_applied_and_keeps_the_first_original():
    T = make_target()
    original = T.__dict__["method"]
    reg = Registry((patch_for(T),))
    reg.apply(FACTS, {})
    [rec] = reg.apply(FACTS, {})
    assert (rec.status, rec.reason) == ("applied", "already applied")
    assert reg.original(T, "method") is original
    reg.revert()
    assert T.__dict__["method"] is original


def test_revert_restores_identity_in_reverse_order_and_is_harmless_twice():
    T = make_target()
    orig_method, orig_static = T.__dict__["method"], T.__dict__["static"]
    reg = Registry((patch_for(T, "method", "a"), patch_for(T, "static", "b")))
    reg.apply(FACTS, {})
    records = reg.revert()
    assert [r.name for r in records] == ["b", "a"]
    assert all(r.status == "reverted" for r in records)
    assert T.__dict__["method"] is orig_method and T.__dict__["static"] is orig_static
    assert isinstance(T.__dict__["static"], staticmethod)
    assert reg.revert() == []
    with pytest.raises(AssertionError, match="patch failed"):
        T().method()


def test_revert_deletes_an_attribute_that_was_inherited():
    T = make_target()
    reg = Registry((patch_for(T, "inherited"),))
    reg.apply(FACTS, {})
    assert T().inherited() == "patched"
    assert reg.undo[0][3] is NOTSET
    reg.revert()
    assert "inherited" not in T.__dict__ and T().inherited() == "base"


def test_skipped_patch_leaves_the_target_alone_and_says_why():
    T = make_target()
    original = T.__dict__["method"]
    [rec] = Registry((patch_for(T, needed=False),)).apply(FACTS, {})
    assert (rec.status, rec.reason) == ("skipped", "not needed here")
    assert T.__dict__["method"] is original


def test_failing_patch_is_recorded_and_the_others_still_apply():
    T = make_target()
    original = T.__dict__["method"]
    reg = Registry((patch_for(T, "method", "broken", fail=True), patch_for(T, "static", "fine")))
    broken, fine = reg.apply(FACTS, {})
    assert broken.status == "failed" and "cannot build" in broken.reason
    assert fine.status == "applied"
    assert T.__dict__["method"] is original


def test_half_built_patch_is_rolled_back():
    T = make_target()
    originals = dict(T.__dict__)

    def build():
        return [(T, "method", lambda self: 1), (T, "static", "not-a-function-so-marking-fails")]

    reg = Registry((Patch("two", "fake.T", lambda f: None, build),))
    [rec] = reg.apply(FACTS, {})
    assert rec.status == "failed"
    assert T.__dict__["method"] is originals["method"] and T.__dict__["static"] is originals["static"]
    assert reg.undo == []


def test_disabled_patch_is_skipped_with_the_switch_named():
    T = make_target()
    enabled = enabled_from(("p1",), {"p1": False})
    [rec] = Registry((patch_for(T),)).apply(FACTS, enabled)
    assert (rec.status, rec.reason) == ("skipped", "disabled by apply(p1=False)")


def test_env_var_disables_by_name(monkeypatch):
    monkeypatch.setenv(ENV_DISABLE, "gdn_thd, mtp_padding_mask")
    assert enabled_from(("gdn_thd", "mtp_padding_mask", "x"), {}) == {
        "gdn_thd": f"disabled by {ENV_DISABLE}=gdn_thd, mtp_padding_mask",
        "mtp_padding_mask": f"disabled by {ENV_DISABLE}=gdn_thd, mtp_padding_mask",
        "x": None,
    }


def test_unknown_switches_are_errors_naming_the_value(monkeypatch):
    with pytest.raises(TypeError, match=r"\['gdn_tdh'\]"):
        enabled_from(("gdn_thd",), {"gdn_tdh": False})
    with pytest.raises(TypeError, match="expects True or False, got 'no'"):
        enabled_from(("gdn_thd",), {"gdn_thd": "no"})
    monkeypatch.setenv(ENV_DISABLE, "gdn_thd,typo")
    with pytest.raises(ValueError, match=r"\['typo'\]"):
        enabled_from(("gdn_thd",), {})


def test_each_decision_is_logged_once_with_the_qualified_target(caplog):
    T = make_target()
    reg = Registry((patch_for(T),))
    with caplog.at_level(logging.INFO, logger="gdn_compat"):
        reg.apply(FACTS, {})
        reg.revert()
        reg.apply(FACTS, {})
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("p1 applied fake.Target.method: ok") == 1
    assert lines.count("p1 reverted fake.Target.method: original restored") == 1


def test_concurrent_apply_patches_once():
    T = make_target()
    reg = Registry((patch_for(T),))
    threads = [threading.Thread(target=reg.apply, args=(FACTS, {})) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg.undo) == 1
