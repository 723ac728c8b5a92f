"""What the probes must find on each real megatron-core release (the CPU-only signature tests).

The expectations are keyed by the release under test, which nox installs one per session; the
probes themselves never look at the version.
"""

from __future__ import annotations

import pytest

import gdn_compat
from gdn_compat.patches import PATCHES, gdn_thd, mtp_padding_mask
from tests.conftest import MEGATRON

GENERATION = {
    "0.15": dict(gdn="absent", gdn_thd="absent", mtp="generic", needs=set()),
    "0.16": dict(gdn="module", gdn_thd="refuses", mtp="generic", needs={"gdn_thd"}),
    "0.17": dict(gdn="module", gdn_thd="refuses", mtp="generic", needs={"gdn_thd"}),
    "0.18": dict(gdn="module", gdn_thd="native", mtp="no_padding_mask", needs={"mtp_padding_mask"}),
    "0.19": dict(gdn="package", gdn_thd="native", mtp="has_padding_mask", needs=set()),
}
release = ".".join((MEGATRON or "none").split(".")[:2])
expected = GENERATION.get(release)
pytestmark = pytest.mark.skipif(expected is None, reason=f"no expectations recorded for megatron-core {MEGATRON}")


def test_gdn_location():
    assert gdn_compat.facts.gdn.split(" ")[0] == expected["gdn"]


def test_gdn_thd_generation():
    assert gdn_compat.facts.gdn_thd == expected["gdn_thd"]
    assert gdn_compat.facts.gdn_legacy_shape == (expected["gdn_thd"] == "refuses")


def test_gdn_context_parallel():
    assert gdn_compat.facts.gdn_cp == {"absent": "absent", "refuses": "none", "native": "native"}[expected["gdn_thd"]]


def test_mtp_checkpointed_forward_generation():
    assert gdn_compat.facts.mtp == expected["mtp"]


def test_exactly_the_needed_patches_are_selected():
    needed = {p.name for p in PATCHES if p.decide(gdn_compat.facts) is None}
    assert needed == expected["needs"]


def test_skips_say_why():
    for mod in (gdn_thd, mtp_padding_mask):
        why = mod.decide(gdn_compat.facts)
        if mod.NAME not in expected["needs"]:
            assert why and (MEGATRON in why or "unknown" in why)


def test_fla_varlen_signatures_are_seen():
    if gdn_compat.facts.fla is None or gdn_compat.facts.fla_error:
        pytest.skip(f"fla not importable here: {gdn_compat.facts.fla_error}")
    assert gdn_compat.facts.fla_rule_cu_seqlens == "yes"
    assert gdn_compat.facts.fla_conv_cu_seqlens == "yes"
