"""Shared fixtures: megatron-core on this machine (CPU stand-ins and gloo, or a GPU), undone at the end."""

from __future__ import annotations

import os
import pathlib

# Without a GPU, gdn_compat's fused Triton kernels run in Triton's interpreter on CPU tensors; the switch is
# read when a kernel is defined, so it is set before anything imports Triton (fla, megatron, gdn_compat).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest

from tests.support import suite_records
from tests.support.release import MEGATRON

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pytest_configure(config):
    config.addinivalue_line("markers", "heavy: a suite run once per distinct megatron-core source in one nox run "
                                       "(tests/support/suite_records.py)")
    worker = hasattr(config, "workerinput")  # a pytest-xdist worker: the controller owns the records
    out = suite_records.folder()
    for stale in (out / "imports").glob("*.json") if out and not worker else ():
        stale.unlink()  # an earlier session that failed before writing its record
    config.stash[_SAME] = suite_records.earlier_identical(MEGATRON) if MEGATRON else None


def pytest_collection_modifyitems(config, items):
    same = config.stash[_SAME]
    if same is None:
        return
    release, files = same
    skip = pytest.mark.skip(reason=f"heavy suite: the {files} megatron-core files it imported under {release} (every "
                                   f"process, package_info.py without its version lines) are byte-identical in "
                                   f"{MEGATRON}; {release} ran it in this nox run")
    for item in items:
        if item.get_closest_marker("heavy"):
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """A whole session that ran the heavy suite and passed leaves its record for the releases after it."""
    config = session.config
    if not suite_records.folder() or not MEGATRON:
        return
    if hasattr(config, "workerinput"):  # an xdist worker: its imports count, the controller writes
        suite_records.log_imports()
        return
    whole = not (config.option.keyword or config.option.markexpr or getattr(config.option, "deselect", None)) \
        and all(pathlib.Path(a).resolve() == ROOT / "tests" for a in config.args)
    if whole and exitstatus == 0 and config.stash[_SAME] is None:
        suite_records.write_record(MEGATRON)


_SAME = pytest.StashKey[tuple | None]()


@pytest.fixture(scope="session")
def megatron_cpu():
    """megatron-core ready on this machine: "cuda" on a GPU machine, else "cpu" (see tests.support.megatron)."""
    if MEGATRON is None:
        pytest.skip("megatron-core is not installed")
    import torch

    from tests.support.megatron import world

    with world(cuda=torch.cuda.is_available()) as device:
        yield device


@pytest.fixture
def fresh_fallback_notes():
    """gdn_compat says each fast-path fallback once per process and reason: a test that looks for one, or rules one
    out, starts with none said, so it sees what its own calls did."""
    from gdn_compat.patches.gdn_thd import fast

    fast.forget_notes()
    yield
    fast.forget_notes()
