"""Shared fixtures: megatron-core on this machine (CPU stand-ins and gloo, or a GPU), undone at the end.

Which release runs what (#55): every release session runs the light tests; the suites marked ``heavy`` run once per
distinct megatron-core source in one nox run (tests/support/suite_records.py; nox runs each minor's newest patch
release first); the tests marked ``interpreted_fused`` (gdn_compat's Triton kernels in Triton's interpreter) run on one
release per GDN generation, those marked ``interpreted_kernels`` (the kernels alone, no megatron-core) on one, and those
marked ``auto_fresh`` (GDN_COMPAT_AUTO's fresh interpreters) in one release
session and in the ``ray`` session (``ONLY_ON``). A megatron source tree (``nox -s source``) and a venv without
megatron-core run everything.
"""

from __future__ import annotations

import contextlib
import os
import pathlib

import pytest

from tests.support import suite_records
from tests.support.interpreter import once_per_launch

ROOT = pathlib.Path(__file__).resolve().parents[1]

# marker: (the releases that run it, why only those)
ONLY_ON = {
    "interpreted_fused": (("0.17.1", "0.19.2"), "gdn_compat's Triton kernels in Triton's interpreter run on one release "
                                                "per GDN generation: 0.17.1 (gdn_thd's packed path) and 0.19.2 (the "
                                                "native THD routes)"),
    "interpreted_kernels": (("0.19.2",), "gdn_compat's Triton kernels alone (no megatron-core code) in Triton's "
                                         "interpreter: the same run in every session, so one release session (0.19.2) "
                                         "and triton_compile(3.7.0), the oldest interpreter that runs them"),
    "auto_fresh": (("0.19.2",), "GDN_COMPAT_AUTO's fresh interpreters run in one release session (0.19.2) and in the "
                                "ray session (GDN_COMPAT_INSTALL_TESTS=1)"),
}


def _interpreter() -> None:
    """Without a GPU, gdn_compat's fused Triton kernels run in Triton's interpreter on CPU tensors; the switch is
    read when a kernel is defined, so it is set before anything imports Triton (fla, megatron, gdn_compat)."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own configure: it registers "dsession" in the controller
def pytest_configure(config):
    config.addinivalue_line("markers", "heavy: a suite run once per distinct megatron-core source in one nox run "
                                       "(tests/support/suite_records.py)")
    for name, (releases, why) in ONLY_ON.items():
        config.addinivalue_line("markers", f"{name}: runs on megatron-core {', '.join(releases)} only ({why})")
    worker = hasattr(config, "workerinput")  # a pytest-xdist worker: the controller owns the records
    controller = config.pluginmanager.getplugin("dsession") is not None  # runs no test: imports neither torch
    if not controller:  # nor megatron-core (~6 s a session)
        _interpreter()
        config.stash[_LAUNCHES] = contextlib.ExitStack()
        config.stash[_LAUNCHES].enter_context(once_per_launch())  # tests/support/interpreter.py
    out = suite_records.folder()
    for stale in (out / "imports").glob("*.json") if out and not worker else ():
        stale.unlink()  # an earlier session that failed before writing its record
    release = _release(controller)
    config.stash[_RELEASE] = release
    config.stash[_SAME] = suite_records.earlier_identical(release) if release else None


def _release(controller: bool) -> str | None:
    if controller:  # package_info.py's version lines, read from the file
        return suite_records.release()
    from tests.support.release import MEGATRON

    return MEGATRON


def _only_here(marker: str, release: str | None) -> str | None:
    """Why a test with ``marker`` is skipped in this session (None: it runs)."""
    releases, why = ONLY_ON[marker]
    if release is None or release in releases:
        return None
    if marker.startswith("interpreted_") and os.environ.get("TRITON_INTERPRET") != "1":
        return None  # on a GPU the kernels are compiled, not interpreted
    if marker == "auto_fresh" and os.environ.get("GDN_COMPAT_INSTALL_TESTS") == "1":
        return None
    from tests.support.release import FACTS

    if "megatron" in FACTS.notes:  # a source tree ahead of the installed release (nox -s source): everything runs
        return None
    return f"{why}; this is {release}"


def pytest_collection_modifyitems(config, items):
    for marker in ONLY_ON:
        marked = any(item.get_closest_marker(marker) for item in items)
        reason = _only_here(marker, config.stash[_RELEASE]) if marked else None
        for item in items if reason else ():
            if item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=reason))
    same = config.stash[_SAME]
    if same is None:
        return
    release, files = same
    skip = pytest.mark.skip(reason=f"heavy suite: the {files} megatron-core files it imported under {release} (every "
                                   f"process, package_info.py without its version lines) are byte-identical in "
                                   f"{config.stash[_RELEASE]}; {release} ran it in this nox run")
    for item in items:
        if item.get_closest_marker("heavy"):
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """A whole session that ran the heavy suite and passed leaves its record for the releases after it."""
    config = session.config
    release = config.stash.get(_RELEASE, None)
    if not suite_records.folder() or not release:
        return
    if hasattr(config, "workerinput"):  # an xdist worker: its imports count, the controller writes
        suite_records.log_imports()
        return
    whole = not (config.option.keyword or config.option.markexpr or getattr(config.option, "deselect", None)) \
        and all(pathlib.Path(a).resolve() == ROOT / "tests" for a in config.args)
    if whole and exitstatus == 0 and config.stash[_SAME] is None:
        suite_records.write_record(release)


def pytest_unconfigure(config):
    if _LAUNCHES in config.stash:
        config.stash[_LAUNCHES].close()


_LAUNCHES = pytest.StashKey[contextlib.ExitStack]()
_SAME = pytest.StashKey[tuple | None]()
_RELEASE = pytest.StashKey[str | None]()


@pytest.fixture(scope="session")
def megatron_cpu():
    """megatron-core ready on this machine: "cuda" on a GPU machine, else "cpu" (see tests.support.megatron)."""
    from tests.support.release import MEGATRON

    if MEGATRON is None:
        pytest.skip("megatron-core is not installed")
    import torch

    from tests.support.megatron import world

    with world(cuda=torch.cuda.is_available()) as device:
        yield device


@pytest.fixture
def small_gdn(megatron_cpu, monkeypatch):
    """A small release GatedDeltaNet in deterministic_mode (the release's unpacked path runs on the CPU there) with a
    torch l2norm, and no pack cached before or after it."""
    from gdn_compat.patches.gdn_thd import PACKS
    from tests.support.gdn import build_gdn, use_torch_l2norm

    use_torch_l2norm(monkeypatch)
    PACKS.clear()
    yield build_gdn(megatron_cpu, deterministic=True, hk=2, hv=4, dk=16, dv=16)
    PACKS.clear()


@pytest.fixture
def fresh_fallback_notes():
    """gdn_compat says each fast-path fallback once per process and reason: a test that looks for one, or rules one
    out, starts with none said, so it sees what its own calls did."""
    from gdn_compat.patches.gdn_thd import fast

    fast.forget_notes()
    yield
    fast.forget_notes()
