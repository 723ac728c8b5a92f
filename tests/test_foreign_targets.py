"""Another library's replacement of a real release target wins (issue 11 item 1), on every release.

The target is the first one ``apply()`` would patch on this release (gdn_thd's ``forward`` on
0.16/0.17, gdn_cp_comm_type's ``__init__`` on 0.18); releases that need no patch are skipped.
"""

from __future__ import annotations

import functools

import pytest

import gdn_compat
from gdn_compat.patches import PATCHES
from tests.support.release import FACTS

PLANNED = [r.name for r in gdn_compat.plan(FACTS) if r.status == "would_apply"]
pytestmark = pytest.mark.skipif(not PLANNED, reason=f"{FACTS.release}: no patch to apply here")


@pytest.fixture
def target(monkeypatch):
    """(patch name, owner class, attribute, the release's object); the owner is restored afterwards."""
    [patch] = [p for p in PATCHES if p.name == PLANNED[0]]
    owner, original = patch.target.resolve()
    monkeypatch.setattr(owner, patch.target.attr, original)  # undone at teardown, whatever a test did
    yield patch.name, owner, patch.target.attr, original
    gdn_compat.revert()


def test_a_library_that_installed_its_own_object_first_is_left_alone(target):
    name, owner, attr, original = target

    def their_own(self, *args, **kwargs):  # e.g. a library's own THD-capable forward
        return original(self, *args, **kwargs)

    setattr(owner, attr, their_own)
    report = gdn_compat.apply()
    assert report[name].status == "skipped"
    assert "no longer the release's own" in report[name].reason and "their_own" in report[name].reason
    assert owner.__dict__[attr] is their_own


def test_a_wrapper_of_the_release_object_is_skipped_unless_forced(target):
    name, owner, attr, original = target

    @functools.wraps(original)  # looks like the release's by qualname and __wrapped__, is not
    def wrapper(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    setattr(owner, attr, wrapper)
    assert gdn_compat.apply()[name].status == "skipped"
    assert owner.__dict__[attr] is wrapper
    gdn_compat.revert()
    forced = gdn_compat.apply(force=[name])
    assert forced[name].status == "applied" and "forced over" in forced[name].reason
    assert owner.__dict__[attr].__wrapped__ is wrapper  # ours calls theirs for what it does not handle
    assert gdn_compat.revert()[name].status == "reverted"
    assert owner.__dict__[attr] is wrapper


def test_revert_keeps_a_wrapper_installed_after_apply(target):
    name, owner, attr, original = target
    assert gdn_compat.apply()[name].status == "applied"
    ours = owner.__dict__[attr]

    def late_wrapper(self, *args, **kwargs):
        return ours(self, *args, **kwargs)

    setattr(owner, attr, late_wrapper)
    rec = gdn_compat.revert()[name]
    assert rec.status == "left_in_place"
    assert rec.reason.startswith("replaced after apply by ") and "late_wrapper" in rec.reason
    assert owner.__dict__[attr] is late_wrapper


def test_force_names_must_be_patches():
    with pytest.raises(TypeError, match=r"unknown patch\(es\) \['gdn_tdh'\]"):
        gdn_compat.apply(force=["gdn_tdh"])


def test_only_torch_compile_s_wrapper_of_the_release_own_function_is_looked_through():
    """megatron's jit_fuser wraps the release's own method (0.18/0.19's _compute_g_and_beta) in torch.compile's
    wrapper: still the release's own. A functools.wraps wrapper of it is someone else's object."""
    import torch

    from gdn_compat._registry import foreign

    class Owner:
        def method(self):
            return 1

    own = Owner.__dict__["method"]
    assert foreign(Owner, "method", torch.compile(own)) is None

    @functools.wraps(own)
    def theirs(self):
        return own(self)

    assert "no longer the release's own" in foreign(Owner, "method", theirs)
