"""GDN_COMPAT_AUTO (#29): gdn_compat applied in a process that never imports it, as megatron-core is imported.

What the ``.pth`` line does with the variable unset and set, the hook in fresh interpreters (before and after
megatron-core is imported), the doctor unaffected by it; and, where gdn_compat is installed from its wheel (the
``ray`` nox session), the real thing: ``tests/support/auto_child.py`` builds 0.16/0.17's GatedDeltaNet and runs a
packed forward + backward, working with the variable and raising the release's NotImplementedError without it.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import site
import subprocess
import sys

import pytest

from tests.support.release import FACTS, MEGATRON

ROOT = pathlib.Path(__file__).resolve().parents[1]
PTH_LINE = (ROOT / "gdn_compat_auto.pth").read_text().strip()


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GDN_COMPAT_AUTO"}
    env.update({k: v for k, v in kw.items() if v is not None})
    return env


def test_the_pth_line_imports_nothing_and_hooks_nothing_when_unset():
    code = PTH_LINE + "\nimport sys\nprint('_gdn_compat_auto' in sys.modules, len(sys.meta_path))"
    run = lambda **kw: subprocess.run([sys.executable, "-S", "-c", code], env=_env(**kw), cwd=ROOT,  # noqa: E731
                                      capture_output=True, text=True, check=True).stdout.split()
    unset, off, on = run(), run(GDN_COMPAT_AUTO="0"), run(GDN_COMPAT_AUTO="1")
    assert unset[0] == off[0] == "False" and unset[1] == off[1]
    assert on[0] == "True" and int(on[1]) == int(unset[1]) + 1  # one finder, at the front of sys.meta_path


def test_an_unknown_value_is_a_warning_and_a_no(monkeypatch, caplog):
    import _gdn_compat_auto

    monkeypatch.setenv("GDN_COMPAT_AUTO", "maybe")
    with caplog.at_level(logging.WARNING, logger="gdn_compat"):
        assert _gdn_compat_auto.requested() is False
    assert "GDN_COMPAT_AUTO='maybe' is neither on" in caplog.text
    for value, want in (("1", True), ("yes", True), ("0", False), ("off", False), ("", False)):
        monkeypatch.setenv("GDN_COMPAT_AUTO", value)
        assert _gdn_compat_auto.requested() is want, value


HOOKED = ("import json, logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
          "import _gdn_compat_auto\n_gdn_compat_auto.install('a test')\nbefore = 'gdn_compat' in sys.modules\n"
          "import megatron.core\nimport gdn_compat\n"
          "print(json.dumps({'before': before, 'applied': list(gdn_compat.report().applied)}))")
LATE = ("import json, logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stderr)\nimport megatron.core\n"
        "import _gdn_compat_auto\n_gdn_compat_auto.install('a late test')\nimport gdn_compat\n"
        "print(json.dumps({'applied': list(gdn_compat.report().applied)}))")


@pytest.fixture(scope="module")
def fresh():
    if MEGATRON is None:
        pytest.skip("megatron-core is not installed")
    logged = "import atexit\nfrom tests.support import suite_records\natexit.register(suite_records.log_imports)\n"
    runs = {"hooked": [sys.executable, "-c", logged + HOOKED], "late": [sys.executable, "-c", logged + LATE],
            "doctor": [sys.executable, "-m", "gdn_compat", "--json"]}
    env = _env(GDN_COMPAT_AUTO=None, TORCH_CUDA_ARCH_LIST=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"))
    procs = {k: subprocess.Popen(cmd, env=dict(env, GDN_COMPAT_AUTO="1") if k == "doctor" else env, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k, cmd in runs.items()}
    out = {}
    for k, proc in procs.items():
        stdout, stderr = proc.communicate()  # reads both pipes to the end, then waits
        out[k] = (proc.returncode, stdout, stderr)
    return out


def _needed() -> set[str]:
    import gdn_compat

    return {r.name for r in gdn_compat.plan(FACTS) if r.status == "would_apply"}


@pytest.mark.heavy
def test_the_hook_applies_once_megatron_core_has_been_imported(fresh):
    code, out, err = fresh["hooked"]
    assert code == 0, err[-3000:]
    data = json.loads(out.strip().splitlines()[-1])
    assert data["before"] is False and set(data["applied"]) == _needed()
    assert "applied from a test when megatron-core was imported" in err


@pytest.mark.heavy
def test_a_hook_installed_after_megatron_core_applies_at_once_and_says_so(fresh):
    code, out, err = fresh["late"]
    assert code == 0, err[-3000:]
    assert set(json.loads(out.strip().splitlines()[-1])["applied"]) == _needed()
    assert "megatron-core was imported before gdn_compat could hook its import (a late test); applying now" in err


@pytest.mark.heavy
def test_the_doctor_shows_the_release_as_it_is_with_the_variable_set(fresh):
    code, out, err = fresh["doctor"]
    data = json.loads(out[out.index("{"):])
    assert code == data["exit"], err[-2000:]
    assert "applied" not in {p["status"] for p in data["patches"]}


def installed_pth() -> pathlib.Path | None:
    """gdn_compat_auto.pth where site reads it: a real (wheel) install of gdn_compat in this interpreter."""
    for folder in site.getsitepackages():
        path = pathlib.Path(folder) / "gdn_compat_auto.pth"
        if path.is_file():
            return path
    return None


def run_child(**env) -> dict:
    out = subprocess.run([sys.executable, "-P", str(ROOT / "tests" / "support" / "auto_child.py")], env=_env(**env),
                         cwd=pathlib.Path(site.getsitepackages()[0]), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "stderr": out.stderr}


@pytest.mark.skipif(installed_pth() is None, reason="gdn_compat is not installed from its wheel here (the ray nox "
                                                    "session installs it and runs this)")
@pytest.mark.skipif(FACTS.gdn_thd != "refuses", reason=f"megatron-core {MEGATRON} packs GDN natively")
def test_an_installed_wheel_applies_in_a_process_that_never_imports_it():
    on = run_child(GDN_COMPAT_AUTO="1", TORCH_CUDA_ARCH_LIST="9.0")
    assert on["ok"] and on["grad_finite"] and "gdn_thd" in on["gdn_compat"]["applied"]
    assert "site-packages" in on["gdn_compat"]["file"] and "applied from GDN_COMPAT_AUTO" in on["stderr"]
    off = run_child(TORCH_CUDA_ARCH_LIST="9.0")
    assert not off["ok"] and off["error"].startswith("NotImplementedError") and off["gdn_compat"] is None
