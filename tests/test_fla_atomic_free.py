"""The probe behind deterministic packed GDN on CUDA (#15): ``atomic_free`` follows the fla code that
the packed path's entry points reach and finds any atomic or accumulating scatter in it, so fla's
kernels run in deterministic mode only where their sums have a fixed order."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from gdn_compat._probe import Accepts, atomic_free
from tests.support.release import FACTS

HELPER = """
def tl_atomic(ptr, x):
    return tl.atomic_add(ptr, x)
"""


@pytest.fixture
def fake_fla(tmp_path, monkeypatch):
    """A package ``fakefla``: entry -> (kernels, wrapped via .fn) -> helper; the helper's body is a parameter."""
    made = []

    def make(helper_body: str):
        root = tmp_path / f"v{len(made)}"
        pkg = root / "fakefla"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "helper.py").write_text(textwrap.dedent(helper_body))
        (pkg / "kernels.py").write_text("from fakefla.helper import *\n\ndef kernel():\n    return 1\n")
        (pkg / "entry.py").write_text(textwrap.dedent("""
            class Autotuner:  # what triton.autotune returns: the kernel is under .fn
                __module__ = "triton.runtime.autotuner"

                def __init__(self, fn):
                    self.fn = fn


            def _kernel():  # no module object left in this module's globals: .fn is the only way on
                from fakefla.kernels import kernel

                return kernel


            tuned = Autotuner(_kernel())


            def entry():
                return tuned
        """))
        for name in [m for m in sys.modules if m.split(".")[0] == "fakefla"]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.syspath_prepend(str(root))
        made.append(root)
        return importlib.import_module("fakefla.entry").entry

    yield make
    for name in [m for m in sys.modules if m.split(".")[0] == "fakefla"]:
        sys.modules.pop(name, None)


def test_an_atomic_two_modules_away_from_the_entry_point_is_found(fake_fla):
    entry = fake_fla(HELPER)
    verdict, note = atomic_free(entry, prefix="fakefla")
    assert verdict is Accepts.NO
    assert "fakefla.helper (tl.atomic_add)" in note, note


@pytest.mark.parametrize("op", ["out.index_add_(0, idx, src)", "out.scatter_add_(0, idx, src)",
                                "out.index_put_((idx,), src, accumulate=True)"])
def test_torch_accumulating_scatters_count_as_atomics(fake_fla, op):
    entry = fake_fla(f"def step(out, idx, src):\n    return {op}\n")
    assert atomic_free(entry, prefix="fakefla")[0] is Accepts.NO


def test_code_without_atomics_is_atomic_free_and_every_reached_module_was_read(fake_fla):
    entry = fake_fla("def plain(x):\n    return x.sum(0)\n")
    verdict, note = atomic_free(entry, prefix="fakefla")
    assert verdict is Accepts.YES
    assert note.startswith("3 modules read"), note  # entry, kernels (through .fn), helper


def test_an_entry_point_outside_fla_is_unknown_not_atomic_free():
    assert atomic_free(len, prefix="fakefla")[0] is Accepts.UNKNOWN


def test_the_installed_fla_packed_path_is_read():
    if FACTS.fla is None:
        pytest.skip("no fla installed")
    assert FACTS.fla_atomic_free in (Accepts.YES, Accepts.NO), FACTS.notes.get("fla_atomic_free")
    assert "modules read" in FACTS.notes["fla_atomic_free"]
