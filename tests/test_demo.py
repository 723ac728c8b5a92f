"""``python -m gdn_compat.demo`` as a user runs it (#54 item 3): from outside the checkout, without pytest or the
tests package; and it fails when packing is not handled."""

from __future__ import annotations

import os
import sys

import pytest

from gdn_compat._probe import Layout, fla_problem
from tests.support.processes import run_together
from tests.support.release import FACTS

DEMO = ["-m", "gdn_compat.demo"]  # the README's command: python -m gdn_compat.demo
# No pytest and no tests package in the demo's process: importing either fails there.
BLOCK = """
import importlib.abc, runpy, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pytest", "_pytest", "tests"):
            raise ModuleNotFoundError(f"the demo imported {name}", name=name)
sys.meta_path.insert(0, Block())
sys.argv = ["gdn_compat.demo"]
runpy.run_module("gdn_compat.demo", run_name="__main__", alter_sys=True)
"""

pytestmark = [pytest.mark.heavy, pytest.mark.skipif(
    FACTS.gdn not in (Layout.MODULE, Layout.PACKAGE) or fla_problem(FACTS) is not None,
    reason=f"{FACTS.release} with {FACTS.fla}: no GatedDeltaNet to build here")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The demo as it ships, and the demo with gdn_compat's packed paths switched off, started together."""
    away = tmp_path_factory.mktemp("away")  # not the checkout: the tests package is not on the path
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)
    off = {**env, "GDN_COMPAT_DISABLE": "gdn_thd,gdn_thd_deterministic"}
    return run_together({"shipped": ([sys.executable, "-c", BLOCK], env), "off": ([sys.executable, *DEMO], off)},
                        cwd=away)


def test_the_demo_runs_a_packed_step_and_finds_it_equal_to_per_sequence_runs(runs):
    code, out, err = runs["shipped"]
    assert code == 0, out[-3000:] + err[-3000:]
    lines = out.splitlines()
    assert lines[0].startswith(f"gdn_compat: {FACTS.release}: applied ")
    path = "gdn_thd" if FACTS.gdn_thd.value == "refuses" else "gdn_thd_deterministic"  # what takes the packed call
    [now] = [line for line in lines if line.startswith("GatedDeltaNet.forward is now: ")]
    assert path in now.split(": ", 1)[1].split(", "), now
    assert sum(line.startswith("  sequence ") for line in lines) == 6
    assert lines[-1] == "verdict: OK: packed equals per-sequence"
    assert "Warning" not in err, err[-2000:]


def test_the_demo_says_failed_when_packing_is_left_to_the_release(runs):
    code, out, _ = runs["off"]
    assert code == 1
    assert out.splitlines()[-1].startswith("verdict: FAILED: the packed step raised ")
