"""Test matrix: one session per megatron-core release, on Python 3.12, with uv.

    nox                                          # every release + lint + the built wheel
    nox -s "tests(0.18.2)"       # one release
    nox -s hf_parity                             # Hugging Face's GDN layers against the packed path (0.17.1, 0.19.2)
    nox -s triton_compile                        # every Triton kernel compiled by each Triton torch 2.7-2.15 ship
    nox -s demo                                  # python -m gdn_compat.demo from the installed package
    nox -s compat_table                          # regenerate the README compatibility table
    nox -s numbers                               # regenerate the README benchmark tables from benchmarks/results
    MEGATRON_SOURCE=/path/to/Megatron-LM nox -s source   # the CPU suite against a megatron source tree (upstream main)
    nox -s wheel                                 # build sdist + wheel, use the wheel from a clean venv
    nox -s ray                                   # GDN_COMPAT_AUTO from the installed wheel: fresh processes, Ray actors

Python 3.12 (megatron-core >= 0.17 requires it): $NOX_PYTHON312 if set, else ``python3.12`` on PATH,
else a pyenv-installed 3.12, else nox's own lookup of "3.12".
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import nox

sys.path.insert(0, os.path.dirname(__file__))
from tests.support import compat_table  # noqa: E402  (stdlib only)

RELEASES = ["0.15.3", "0.16.0", "0.16.1", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.18.2",
            "0.19.0", "0.19.1", "0.19.2"]
# The release sessions run each minor's newest patch release first: it runs the heavy suites, and an older patch
# release skips them where every file they imported is byte-identical to one that ran them (tests/support/suite_records.py)
NEWEST_FIRST = sorted(RELEASES, key=lambda v: (tuple(map(int, v.split(".")[:2])), -int(v.split(".")[2])))
# Test-only stack, pinned so uv's cache serves every session the same ~3 GB torch wheel.
# fla-core 0.6.0 imports with this torch's Triton (0.4.x does not); CPU tests never run its kernels.
TORCH = "torch==2.15.0"
FLA = "fla-core==0.6.0"
TEST_DEPS = [TORCH, FLA, "pytest>=8", "pytest-xdist>=3", "numpy"]
# pytest-xdist: one worker per core (at most 4), each test file whole in one worker (a file's module fixtures, e.g.
# the acceptance matrix, are computed once); measured 895 s -> 492 s for the 0.19.2 session on the 2-core machine
WORKERS = ["-n", str(min(4, os.cpu_count() or 1)), "--dist", "loadfile"]


def _python312() -> str:
    for candidate in (os.environ.get("NOX_PYTHON312"), shutil.which("python3.12")):
        if candidate and subprocess.run([candidate, "--version"], capture_output=True).returncode == 0:
            return candidate
    pyenv = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python")))
    return pyenv[-1] if pyenv else "3.12"


PYTHON = _python312()
# Records of which heavy suites ran on which megatron-core files, for this nox run only (tests/support/suite_records.py)
RECORDS = tempfile.mkdtemp(prefix="gdn-compat-suites-")
# Python writes bytecode in each venv as usual (a machine-wide PYTHONDONTWRITEBYTECODE=1 made every interpreter a
# session starts, workers, ranks and fresh processes alike, compile torch's and megatron-core's ~3,000 modules again:
# ~8 of its ~14 CPU seconds to import them)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# One torch.compile (inductor) cache for the sessions of this nox run: nox points TMPDIR into each venv, where
# inductor keeps its cache by default, so every session compiled the same CPU kernels again (~9 s a compiled test)
INDUCTOR = tempfile.mkdtemp(prefix="gdn-compat-inductor-")

# megatron-core 0.15.x compiles a CUDA extension when megatron.core is imported; on a machine
# without a GPU torch's arch detection then raises IndexError (which 0.15.x does not catch) unless
# the arch list is given. The compile then fails cleanly and megatron carries on without it.
# One OpenMP thread per process: a session runs two pytest workers (or two gloo ranks, or a fresh interpreter beside
# a worker) on the two cores, and torch's default of one thread per core oversubscribed them; on the suite's small
# tensors the threads spun waiting on each other (the 1-rank acceptance matrix: 38 s of wall time with two threads a
# process, 9 s with one, measured 2026-12-06 beside another nox run)
THREADS = {"OMP_NUM_THREADS": "1"}
CPU_ENV = {"PYTHONWARNINGS": "ignore", "TORCH_CUDA_ARCH_LIST": "9.0", "TORCHINDUCTOR_CACHE_DIR": INDUCTOR, **THREADS}

# CI compiles with the oldest Triton, the oldest whose interpreter runs the kernels, and the newest (the whole matrix,
# all 8, is `nox -s triton_compile`: every one compiled every kernel on 2026-12-02), to keep the command's time
nox.options.sessions = ["tests", "hf_parity", "triton_compile(3.3.1)", "triton_compile(3.7.0)", "triton_compile(3.9.0)",
                        "source", "ray", "lint", "wheel"]
# transformers 5.25 needs a kernels release this index lacks; 5.23 has both Qwen3-Next's and Qwen3.5's GDN layers
TRANSFORMERS = "transformers==5.23.0"
nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
# every session's result and duration in seconds (the per-session table of docs/tests.md); --report FILE overrides
os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".nox"), exist_ok=True)
nox.options.report = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".nox", "report.json")


# Bytecode shared by the sessions of one nox run (#55). uv links every venv's copy of a wheel's file to the one file in
# its cache (a hard link: the same inode), so the .pyc an earlier session compiled from it is valid in the next (Python
# checks the source's mtime and size, and fixes each code object's file name when it loads one). Without this every
# session's first processes compiled torch's modules again, each of two pytest workers at once (tests(0.19.1) in a new
# venv after tests(0.19.0), light tests only: 44 and 50 s without, 34 s with; `import torch, megatron.core` 14 CPU
# seconds without its bytecode, 6.6 s with torch's, 2026-12-07).
_VENVS: list[str] = []  # site-packages of this run's earlier sessions, read when a later session starts
_PYC: dict[tuple[int, int], str] = {}  # (device, inode) of a source file -> a .pyc compiled from it


def _share_bytecode(session: nox.Session) -> None:
    """Link into this session's venv the .pyc files earlier sessions of this run compiled from the same files."""
    site = session.run("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True)
    if not site:  # --install-only: nothing runs
        return
    for venv in _VENVS:
        for root, _, files in os.walk(venv):
            if os.path.basename(root) == "__pycache__":
                for name in files:
                    try:
                        source = os.stat(os.path.join(os.path.dirname(root), name.split(".", 1)[0] + ".py"))
                    except OSError:
                        continue
                    _PYC.setdefault((source.st_dev, source.st_ino), os.path.join(root, name))
    _VENVS.clear()
    site, linked = site.strip(), 0
    for root, _, files in os.walk(site):
        for name in files:
            pyc = _PYC.get(_inode(os.path.join(root, name))) if name.endswith(".py") else None
            target = os.path.join(root, "__pycache__", os.path.basename(pyc)) if pyc else ""
            if not pyc or os.path.exists(target):
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            try:
                os.link(pyc, target)
            except OSError:
                shutil.copy2(pyc, target)
            linked += 1
    _VENVS.append(site)
    session.log(f"{linked} modules' bytecode from earlier sessions of this run")


def _inode(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


@nox.session(python=PYTHON)
@nox.parametrize("megatron_core", NEWEST_FIRST, ids=NEWEST_FIRST)
def tests(session: nox.Session, megatron_core: str) -> None:
    session.install(*TEST_DEPS, f"megatron-core=={megatron_core}")
    session.install("--no-deps", "-e", ".")
    _share_bytecode(session)
    session.run("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-W", "ignore::UserWarning",
                "-W", "ignore::DeprecationWarning", *WORKERS, *session.posargs,
                env={**CPU_ENV, "GDN_COMPAT_SUITE_RECORDS": RECORDS})


@nox.session(python=PYTHON)
@nox.parametrize("megatron_core", ["0.17.1", "0.19.2"], ids=["0.17.1", "0.19.2"])
def hf_parity(session: nox.Session, megatron_core: str) -> None:
    """Hugging Face's Qwen3-Next / Qwen3.5 GatedDeltaNet on each document alone against the release's layer run by
    gdn_compat on the pack (tests/test_hf_parity.py); transformers is a test-only dependency of this session."""
    session.install(*TEST_DEPS, f"megatron-core=={megatron_core}", TRANSFORMERS)
    session.install("--no-deps", "-e", ".")
    _share_bytecode(session)
    session.run("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-W", "ignore::UserWarning",
                "-W", "ignore::DeprecationWarning", "tests/test_hf_parity.py", *session.posargs, env=CPU_ENV)


# The Triton each torch 2.7-2.15 ships (torch -> triton from PyPI metadata): 2.7 3.3.1, 2.8 3.4.0, 2.9 3.5.1,
# 2.10/2.11 3.6.0, 2.12 3.7.0, 2.13 3.7.1, 2.14 3.8.0, 2.15 3.9.0
TRITONS = ["3.3.1", "3.4.0", "3.5.1", "3.6.0", "3.7.0", "3.7.1", "3.8.0", "3.9.0"]
# Triton's interpreter runs the fused kernels from 3.7.0 on (3.5.1 and 3.6.0 fail inside it: "only 0-dimensional
# arrays can be converted to Python scalars"); the release sessions run them on torch 2.15's 3.9.0
INTERPRETER_OLDEST = "3.7.0"


@nox.session(python=PYTHON)
@nox.parametrize("triton", TRITONS, ids=TRITONS)
def triton_compile(session: nox.Session, triton: str) -> None:
    """Every gdn_compat Triton kernel, in every launch configuration the code picks, compiled by this Triton for sm80,
    sm90 and sm100 without a GPU (tests/support/triton_compile.py); this session's torch only shapes the launches."""
    session.install(TORCH, "numpy", "packaging")
    session.install("--no-deps", f"triton=={triton}")  # torch pins its own Triton: this one replaces it
    session.install("--no-deps", "-e", ".")
    _share_bytecode(session)
    session.run("python", "-W", "ignore", "-m", "tests.support.triton_compile", *session.posargs,
                env={"TRITON_INTERPRET": "0"})
    if triton == INTERPRETER_OLDEST:  # the fused kernels through the oldest interpreter that runs them
        session.install("pytest>=8", "pytest-xdist>=3")  # two files: their tests spread over the workers
        session.run("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-W", "ignore", "-n", WORKERS[1],
                    "--dist", "load", "tests/test_fused_kernels.py", "tests/test_interpreter_support.py",
                    env={"TRITON_INTERPRET": "1", **THREADS})


@nox.session(python=PYTHON)
def source(session: nox.Session) -> None:
    """The CPU suite against a megatron source tree ahead of megatron-core 0.19.2 (its dependencies), e.g. upstream
    main: ``MEGATRON_SOURCE=/path/to/Megatron-LM nox -s source`` (the directory that holds ``megatron/``). Skipped
    when MEGATRON_SOURCE is unset; the release sessions stay as they are."""
    src = os.environ.get("MEGATRON_SOURCE")
    if not src:
        session.skip("MEGATRON_SOURCE is unset: set it to a Megatron-LM checkout (the directory holding megatron/) "
                     "to run the CPU suite against that source tree")
    if not os.path.isfile(os.path.join(src, "megatron", "core", "package_info.py")):
        session.error(f"MEGATRON_SOURCE={src!r} holds no megatron/core/package_info.py")
    session.install(*TEST_DEPS, "megatron-core==0.19.2")
    session.install("--no-deps", "-e", ".")
    session.run("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-W", "ignore::UserWarning",
                "-W", "ignore::DeprecationWarning", *session.posargs, env={**CPU_ENV, "PYTHONPATH": src})


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff", "mypy", "packaging", TORCH)
    session.run("ruff", "check", "gdn_compat", "_gdn_compat_auto.py", "setup.py", "tests", "benchmarks", "examples",
                "noxfile.py")
    session.run("mypy", "gdn_compat")
    session.run("python", "-m", "tests.support.import_circles")  # no import circle in the runtime package (#39)


@nox.session(python=PYTHON)
def wheel(session: nox.Session) -> None:
    """Build the sdist and wheel, install the wheel (not the checkout) next to a megatron-core release
    in a clean venv, and use it from outside the checkout: the doctor's JSON and the public API."""
    dist = os.path.join(session.create_tmp(), "dist")
    shutil.rmtree(dist, ignore_errors=True)
    session.run("uv", "build", "--sdist", "--wheel", "--out-dir", dist, external=True, silent=True)
    built = sorted(os.listdir(dist))
    session.log(f"built {built}")
    if not any(f.endswith(".tar.gz") for f in built):
        session.error(f"no sdist in {built}")
    [whl] = [os.path.join(dist, f) for f in built if f.endswith(".whl")]
    session.install(TORCH, FLA, "megatron-core==0.17.1", whl)
    _share_bytecode(session)
    away = session.create_tmp()  # not the checkout: only the installed wheel can be imported
    code = ("import json, subprocess, sys, gdn_compat\n"
            "assert 'site-packages' in gdn_compat.__file__, gdn_compat.__file__\n"
            "out = subprocess.run([sys.executable, '-m', 'gdn_compat', '--json'], capture_output=True, text=True)\n"
            "data = json.loads(out.stdout)\n"
            "assert out.returncode == (0 if data['ok'] else 1), out.returncode\n"
            "report = gdn_compat.apply()\n"
            "assert report['gdn_thd'].status == 'applied', report['gdn_thd']\n"
            "assert {p['name'] for p in data['patches'] if p['status'] == 'would_apply'} == set(report.applied)\n"
            "assert {r.name for r in gdn_compat.revert() if r.status == 'reverted'} == set(report.applied)\n"
            "print('wheel OK:', gdn_compat.__file__, sorted(report.applied))\n")
    with session.chdir(away):
        session.run("python", "-c", code, env=CPU_ENV)


def _built_wheel(session: nox.Session) -> str:
    dist = os.path.join(session.create_tmp(), "dist")
    shutil.rmtree(dist, ignore_errors=True)
    session.run("uv", "build", "--wheel", "--out-dir", dist, external=True, silent=True)
    [whl] = [os.path.join(dist, f) for f in os.listdir(dist) if f.endswith(".whl")]
    return whl


@nox.session(python=PYTHON)
def ray(session: nox.Session) -> None:
    """GDN_COMPAT_AUTO for real (#29): gdn_compat installed from its wheel (not editable) beside megatron-core 0.17.1
    and ray; fresh processes and Ray actors that never import gdn_compat (tests/test_auto.py, tests/test_ray.py)."""
    session.install(*TEST_DEPS, "megatron-core==0.17.1", "ray==2.60.0", _built_wheel(session))
    _share_bytecode(session)
    session.run("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-W", "ignore::UserWarning",
                "-W", "ignore::DeprecationWarning", *WORKERS, "tests/test_auto.py", "tests/test_ray.py", *session.posargs,
                env={**CPU_ENV, "GDN_COMPAT_INSTALL_TESTS": "1"})
    # an editable install (uv pip install -e ., PEP 660) hooks as the wheel does (#40): the same child, run again
    session.install("--no-deps", "--reinstall", "-e", ".")
    session.run("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-W", "ignore::UserWarning",
                "-W", "ignore::DeprecationWarning", "tests/test_auto.py", "-k", "an_installed_wheel",
                env={**CPU_ENV, "GDN_COMPAT_INSTALL_TESTS": "1"})


@nox.session(python=PYTHON)
@nox.parametrize("megatron_core", ["0.17.1", "0.19.2"], ids=["0.17.1", "0.19.2"])
def demo(session: nox.Session, megatron_core: str) -> None:
    """``python -m gdn_compat.demo`` as a user runs it: gdn_compat installed from the checkout as a package (not
    editable), run from outside the checkout, on the CPU: one packed GDN step against per-sequence runs."""
    session.install(TORCH, FLA, f"megatron-core=={megatron_core}")
    session.install("--no-deps", "--reinstall", ".")
    with session.chdir(session.create_tmp()):
        session.run("python", "-m", "gdn_compat.demo", env=CPU_ENV)


@nox.session(python=PYTHON)
def numbers(session: nox.Session) -> None:
    """The README's benchmark tables rendered from benchmarks/results/*.json (tests/test_numbers.py checks them)."""
    session.run("python", "-m", "tests.support.numbers")


@nox.session(name="compat_table", python=PYTHON)
def compat_table_session(session: nox.Session) -> None:
    """The doctor's --json on every release, rendered into the README between its markers."""
    session.install("--no-deps", "-e", ".")
    rows = []
    for release in RELEASES:
        session.install(*TEST_DEPS, f"megatron-core=={release}")
        out = session.run("python", "-m", "gdn_compat", "--json", silent=True, env=CPU_ENV, success_codes=[0, 1])
        rows.append(compat_table.row(json.loads(out[out.index('{\n  "gdn_compat"'):])))  # after any stderr
    session.log(compat_table.update_readme("README.md", rows))
