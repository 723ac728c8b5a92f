"""Test matrix: one session per megatron-core release, on Python 3.12, with uv.

    nox                                          # every release + lint
    nox -s "tests(megatron_core='0.18.2')"       # one release
    nox -s demo                                  # the CPU demo (megatron-core 0.17.1)
    nox -s compat_table                          # regenerate the README compatibility table
"""

from __future__ import annotations

import os

import nox

RELEASES = ["0.15.3", "0.16.0", "0.16.1", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.18.2",
            "0.19.0", "0.19.1", "0.19.2"]
PY312 = "/root/.pyenv/versions/3.12.1/bin/python"
PYTHON = PY312 if os.path.exists(PY312) else "3.12"  # megatron-core >= 0.17 requires 3.12
# Test-only stack, pinned so uv's cache serves every session the same ~3 GB torch wheel.
# fla-core 0.6.0 imports with this torch's Triton (0.4.x does not); CPU tests never run its kernels.
TORCH = "torch==2.15.0"
FLA = "fla-core==0.6.0"
TEST_DEPS = [TORCH, FLA, "pytest>=8", "numpy"]

# megatron-core 0.15.x compiles a CUDA extension when megatron.core is imported; on a machine
# without a GPU torch's arch detection then raises IndexError (which 0.15.x does not catch) unless
# the arch list is given. The compile then fails cleanly and megatron carries on without it.
CPU_ENV = {"PYTHONWARNINGS": "ignore", "TORCH_CUDA_ARCH_LIST": "9.0"}

nox.options.sessions = ["tests", "lint"]
nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True


@nox.session(python=PYTHON)
@nox.parametrize("megatron_core", RELEASES, ids=RELEASES)
def tests(session: nox.Session, megatron_core: str) -> None:
    session.install(*TEST_DEPS, f"megatron-core=={megatron_core}")
    session.install("--no-deps", "-e", ".")
    session.run("python", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-W", "ignore::UserWarning",
                "-W", "ignore::DeprecationWarning", *session.posargs, env=CPU_ENV)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff", "mypy", "packaging", TORCH)
    session.run("ruff", "check", "gdn_compat", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("mypy", "gdn_compat")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Packed (THD) GDN forward/backward on megatron-core 0.17.1, on the CPU, through the shim."""
    session.install(*TEST_DEPS, "megatron-core==0.17.1")
    session.install("--no-deps", "-e", ".")
    session.run("python", "examples/cpu_demo.py", env=CPU_ENV)


def _table_rows(session: nox.Session) -> list[str]:
    rows = []
    for release in RELEASES:
        session.install(*TEST_DEPS, f"megatron-core=={release}")
        rows.append(session.run("python", "-m", "gdn_compat", "--table-row", silent=True,
                                env=CPU_ENV).strip().splitlines()[-1])
    return rows


@nox.session(name="compat_table", python=PYTHON)
def compat_table_session(session: nox.Session) -> None:
    session.install("--no-deps", "-e", ".")
    session.install("packaging")
    session.run("python", "-m", "gdn_compat._table", "README.md", *_table_rows(session), env=CPU_ENV)
