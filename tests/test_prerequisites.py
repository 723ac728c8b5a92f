"""Without fla (or with a broken one), every patch that needs it says so and says the fix (#54 item 1).

megatron-core's GatedDeltaNet imports its kernels from fla-core; gdn_compat's packed paths run them. Without fla the
release's GDN module still imports (it catches the ImportError) but lacks fla's names, so the probe used to read the
0.16/0.17 shape as unknown and gdn_thd, the patch those users come for, was skipped as "unknown GatedDeltaNet shape".
A fresh process is started with fla made unimportable (a finder on sys.meta_path, and no fla-core in the installed
distributions' metadata), as a venv without fla-core is; another with an fla whose import raises, as fla-core 0.4.x
does under Triton >= 3.7.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

import gdn_compat
from gdn_compat._probe import FLA_FIX, Accepts, Layout, Thd, Varlen
from gdn_compat.patches import PATCHES
from tests.support.processes import run_together
from tests.support.release import FACTS

OPT_IN = {p.name: True for p in PATCHES if p.opt_in}
needs_gdn = pytest.mark.skipif(FACTS.gdn not in (Layout.MODULE, Layout.PACKAGE),
                               reason=f"{FACTS.release} has no GatedDeltaNet: fla changes nothing here")

# A child that makes fla unimportable ("missing") or makes its import raise ("broken") before anything imports it,
# then prints what apply() would do and the hazards, as JSON.
CHILD = """
import importlib.abc, importlib.metadata as md, json, sys
mode = sys.argv[1]
class Fla(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fla" or name.startswith("fla."):
            if mode == "missing":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            raise ValueError("fla-core 0.4.2 does not support this Triton")
        return None
sys.meta_path.insert(0, Fla())
if mode == "missing":
    version = md.version
    def without_fla(name):
        if name in ("fla-core", "flash-linear-attention"):
            raise md.PackageNotFoundError(name)
        return version(name)
    md.version = without_fla
import gdn_compat
from gdn_compat.hazards import check
facts = gdn_compat.probe()
plan = gdn_compat.plan(facts, **{p.name: True for p in __import__("gdn_compat.patches").patches.PATCHES if p.opt_in})
print(json.dumps({"plan": {r.name: [r.status, r.reason] for r in plan},
                  "findings": [f.code for f in check(facts)], "fla_modules": sorted(m for m in sys.modules if m.startswith("fla"))}))
"""


@pytest.fixture(scope="module")
def children():
    out = {}
    for mode, (code, stdout, stderr) in run_together({m: ([sys.executable, "-c", CHILD, m], None)
                                                      for m in ("missing", "broken")}).items():
        assert code == 0, stderr[-3000:]
        out[mode] = json.loads(stdout.strip().splitlines()[-1])
    return out


def needs_fla() -> set[str]:
    """The patches that run fla's kernels on this release (their decisions must name fla when it is missing)."""
    if FACTS.gdn_thd is Thd.REFUSES:  # 0.16/0.17: gdn_thd is the packed path; config_gdn_cp needs gdn_thd
        return {"gdn_thd", "gdn_thd_unpacked", "gdn_fused", "gdn_flashqla", "gdn_cp_state", "config_gdn_cp"}
    per_sequence = {"gdn_thd_cp_fused"} if FACTS.gdn_cp_per_sequence else set()  # 0.18
    return {"gdn_thd_deterministic", "gdn_thd_graph_safe", "gdn_thd_zero_length", "gdn_fused", "gdn_flashqla",
            "gdn_cp_state", "config_gdn_cp", *per_sequence}  # 0.18/0.19: config_gdn_cp needs gdn_cp_state


def without_fla():
    """This release's facts as the probe finds them without fla (checked in a fresh process below): no fla-core, no
    varlen entry points, and on 0.16/0.17 a GDN module without fla's l2norm, so not the exact 0.16/0.17 shape."""
    return dataclasses.replace(FACTS, fla=None, fla_varlen=Varlen(), fla_atomic_free=Accepts.ABSENT,
                               fla_zero_length=Accepts.ABSENT, gdn_legacy_shape=False)


def _says_fla_and_fix(reason: str) -> bool:
    return "fla-core is not installed" in reason and FLA_FIX in reason


@needs_gdn
def test_without_fla_each_patch_that_needs_it_names_fla_and_the_fix():
    """The decisions on facts without fla (what the probe finds then, checked in a fresh process below)."""
    plan = {r.name: r for r in gdn_compat.plan(without_fla(), **OPT_IN)}
    base = {r.name: r for r in gdn_compat.plan(FACTS, **OPT_IN)}
    wrong = {n: plan[n].reason for n in needs_fla() if not _says_fla_and_fix(plan[n].reason)}
    assert wrong == {}, wrong
    assert all(plan[n].status == "skipped" for n in needs_fla())
    unaffected = {n: (base[n].status, plan[n].status) for n in set(plan) - needs_fla() if base[n].status != plan[n].status}
    assert unaffected == {}, f"patches that do not run fla's kernels changed: {unaffected}"


@needs_gdn
@pytest.mark.heavy
def test_in_a_process_without_fla_every_patch_that_needs_it_says_so(children):
    got = children["missing"]
    assert got["fla_modules"] == [], got["fla_modules"]  # the child really ran without fla
    reasons = {n: reason for n, (_, reason) in got["plan"].items()}
    wrong = {n: reasons[n] for n in needs_fla() if not _says_fla_and_fix(reasons[n])}
    assert wrong == {}, wrong
    assert "fla-missing" in got["findings"]
    base = {r.name: r.status for r in gdn_compat.plan(FACTS, **OPT_IN)}
    changed = {n for n, (status, _) in got["plan"].items() if status != base[n]} - needs_fla()
    assert changed == set(), {n: got["plan"][n] for n in changed}


@needs_gdn
@pytest.mark.heavy
def test_with_an_fla_that_fails_to_import_every_gdn_patch_says_so(children):
    """Such an fla breaks the import of megatron's GDN module itself (it catches only ImportError): every GDN patch
    is skipped, each with fla's error and the fix, not as an unknown shape."""
    got = children["broken"]
    gdn = {p.name for p in PATCHES if p.target.module.startswith("megatron.core.ssm")} | {"config_gdn_cp",
                                                                                          "gdn_out_norm_tp_grad"}
    wrong = {n: reason for n, (status, reason) in got["plan"].items() if n in gdn and not (
        status == "skipped" and "fails to import (ValueError: fla-core 0.4.2 does not support this Triton)" in reason
        and "install the fla-core release made for Triton" in reason)}
    assert wrong == {}, wrong
    assert "fla-import" in got["findings"] and "unknown-shape" not in got["findings"]
