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

from tests.support.processes import run_together
from tests.support.release import FACTS, MEGATRON

ROOT = pathlib.Path(__file__).resolve().parents[1]
PTH_LINE = (ROOT / "gdn_compat_auto.pth").read_text().strip()


# GDN_COMPAT_AUTO's fresh interpreters: in one release session (0.19.2) and in the ray session (tests/conftest.py)
fresh_interpreters = pytest.mark.auto_fresh


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GDN_COMPAT_AUTO"}
    env.update({k: v for k, v in kw.items() if v is not None})
    return env


@fresh_interpreters
def test_the_pth_line_imports_nothing_and_hooks_nothing_when_unset_or_off():
    code = PTH_LINE + "\nimport sys\nprint('_gdn_compat_auto' in sys.modules, len(sys.meta_path))"
    run = lambda **kw: subprocess.run([sys.executable, "-S", "-c", code], env=_env(**kw), cwd=ROOT,  # noqa: E731
                                      capture_output=True, text=True, check=True).stdout.split()
    unset, on = run(), run(GDN_COMPAT_AUTO="1")
    for value in ("0", "false", "no", "off", "OFF", " No "):  # every off value: not even an import
        assert run(GDN_COMPAT_AUTO=value) == unset, value
    assert unset[0] == "False"
    assert on[0] == "True" and int(on[1]) == int(unset[1]) + 1  # one finder, at the front of sys.meta_path


@fresh_interpreters
def test_an_unknown_value_warns_once_per_process_however_often_it_is_read():
    code = ("import logging, sys\nlogging.basicConfig(stream=sys.stderr)\nimport _gdn_compat_auto\n"
            "for value in ('2', '00'):\n    assert not _gdn_compat_auto.requested()\n"
            "_gdn_compat_auto.requested(); _gdn_compat_auto.requested()\nimport gdn_compat")  # + the .pth, if installed
    out = subprocess.run([sys.executable, "-c", code], env=_env(GDN_COMPAT_AUTO="maybe"), cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert out.stderr.count("is neither on") == 1, out.stderr


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
          "import _gdn_compat_auto\n_gdn_compat_auto.install('a test', 'gdn_compat:_apply_from_hook')\nbefore = 'gdn_compat' in sys.modules\n"
          "import megatron.core\nimport gdn_compat\n"
          "print(json.dumps({'before': before, 'applied': list(gdn_compat.report().applied)}))")
LATE = ("import json, logging, sys\nlogging.basicConfig(level=logging.INFO, stream=sys.stderr)\nimport megatron.core\n"
        "import _gdn_compat_auto\n_gdn_compat_auto.install('a late test', 'gdn_compat:_apply_from_hook')\nimport gdn_compat\n"
        "print(json.dumps({'applied': list(gdn_compat.report().applied)}))")


# GDN_COMPAT_AUTO=1 in each of these; the hook installed by hand too (a no-op where the installed .pth did it)
HOOK = "import json, logging, sys\nimport _gdn_compat_auto\n_gdn_compat_auto.install('a test', 'gdn_compat:_apply_from_hook')\n"
REPORT = "\nimport gdn_compat\nprint(json.dumps({'applied': list(gdn_compat.report().applied)}))"
LOG = "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
SWITCHED = "gdn_out_norm_tp_grad"  # applied on every release with GDN
EXPLICIT = {  # explicit code wins over the environment (#40)
    "explicit-first": HOOK + LOG + f"import gdn_compat\ngdn_compat.apply({SWITCHED}=False)\nimport megatron.core"
                      + REPORT,
    "plan-only": HOOK + LOG + "import gdn_compat\ngdn_compat.plan()\nimport megatron.core" + REPORT,
    "hook-then-explicit": HOOK + LOG + f"import megatron.core\nimport gdn_compat\ngdn_compat.apply({SWITCHED}=False)"
                          + REPORT,
    "log-variable": HOOK + "import megatron.core" + REPORT,  # GDN_COMPAT_LOG=info, no logging set up by the script
    # gdn_compat.auto() while another thread is still importing megatron.core: its __init__ starts only once auto()
    # returned (two events, no sleeps; the 60 s are a bound for a broken run, never waited out by a passing one)
    "thread": HOOK.replace("_gdn_compat_auto.install('a test', 'gdn_compat:_apply_from_hook')\n", "") + LOG + (
        "import importlib.machinery, threading\n"
        "started, go = threading.Event(), threading.Event()\n"
        "class Held:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name != 'megatron.core':\n            return None\n"
        "        spec = importlib.machinery.PathFinder.find_spec(name, path)\n"
        "        inner = spec.loader.exec_module\n"
        "        spec.loader.exec_module = lambda m: (started.set(), go.wait(60), inner(m))\n"
        "        return spec\n"
        "sys.meta_path.insert(0, Held())\n"
        "t = threading.Thread(target=lambda: __import__('megatron.core'))\nt.start()\nassert started.wait(60)\n"
        "assert 'megatron.core' in sys.modules and sys.modules['megatron.core'].__spec__._initializing\n"
        "import gdn_compat\ngdn_compat.auto()\ngo.set()\nt.join()\n"
        "[h.join() for h in threading.enumerate() if h.name == 'gdn_compat-auto']" + REPORT),
}


@pytest.fixture(scope="module")
def fresh():
    if MEGATRON is None:
        pytest.skip("megatron-core is not installed")
    logged = "import atexit\nfrom tests.support import suite_records\natexit.register(suite_records.log_imports)\n"
    runs = {"hooked": [sys.executable, "-c", logged + HOOKED], "late": [sys.executable, "-c", logged + LATE],
            "doctor": [sys.executable, "-m", "gdn_compat", "--json"],
            **({k: [sys.executable, "-c", logged + code] for k, code in EXPLICIT.items()} if INSTALL_TESTS else {})}
    env = _env(GDN_COMPAT_AUTO=None, TORCH_CUDA_ARCH_LIST=os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"))
    auto = {"doctor": {}, **{k: {"GDN_COMPAT_LOG": "info"} if k == "log-variable" else {} for k in EXPLICIT}}
    return run_together({k: (cmd, dict(env, GDN_COMPAT_AUTO="1", **auto[k]) if k in auto else env)
                         for k, cmd in runs.items()}, cwd=ROOT)


def _needed() -> set[str]:
    import gdn_compat

    return {r.name for r in gdn_compat.plan(FACTS) if r.status == "would_apply"}


@pytest.mark.heavy
@fresh_interpreters
def test_the_hook_applies_once_megatron_core_has_been_imported(fresh):
    code, out, err = fresh["hooked"]
    assert code == 0, err[-3000:]
    data = json.loads(out.strip().splitlines()[-1])
    assert data["before"] is False and set(data["applied"]) == _needed()
    assert "(from a test, when megatron-core was imported)" in err


@pytest.mark.heavy
@fresh_interpreters
def test_a_hook_installed_after_megatron_core_applies_at_once_and_says_so(fresh):
    code, out, err = fresh["late"]
    assert code == 0, err[-3000:]
    assert set(json.loads(out.strip().splitlines()[-1])["applied"]) == _needed()
    assert "megatron-core was imported before gdn_compat could hook its import (a late test); applying now" in err


@pytest.mark.heavy
@fresh_interpreters
def test_the_doctor_shows_the_release_as_it_is_with_the_variable_set(fresh):
    code, out, err = fresh["doctor"]
    data = json.loads(out[out.index("{"):])
    assert code == data["exit"], err[-2000:]
    assert "applied" not in {p["status"] for p in data["patches"]}


# the hook's behaviour does not depend on the release: its eight fresh processes run once, in the ray session
INSTALL_TESTS = os.environ.get("GDN_COMPAT_INSTALL_TESTS") == "1"
explicit = pytest.mark.skipif(not INSTALL_TESTS, reason="the ray nox session runs these fresh processes "
                                                         "(GDN_COMPAT_INSTALL_TESTS=1): the hook is the same on every release")


def _applied(run) -> set[str]:
    code, out, err = run
    assert code == 0, err[-3000:]
    return set(json.loads(out.strip().splitlines()[-1])["applied"])


@explicit
@pytest.mark.heavy
@fresh_interpreters
def test_an_apply_with_switches_before_megatron_is_imported_decides_not_the_variable(fresh):
    assert _applied(fresh["explicit-first"]) == _needed() - {SWITCHED}


@explicit
@pytest.mark.heavy
@fresh_interpreters
def test_an_apply_with_switches_after_the_hook_applied_replaces_what_the_hook_did(fresh):
    assert _applied(fresh["hook-then-explicit"]) == _needed() - {SWITCHED}
    assert f"gdn_compat.apply({SWITCHED}=False) decides over GDN_COMPAT_AUTO" in fresh["hook-then-explicit"][2]


@explicit
@pytest.mark.heavy
@fresh_interpreters
def test_plan_never_applies_and_says_the_variable_defers_to_it(fresh):
    assert _applied(fresh["plan-only"]) == set()
    assert "the variable defers to the process's own calls, so nothing is applied" in fresh["plan-only"][2]


@explicit
@pytest.mark.heavy
@fresh_interpreters
def test_the_log_variable_shows_one_summary_line_without_code(fresh):
    code, out, err = fresh["log-variable"]
    assert _applied(fresh["log-variable"]) == _needed()
    lines = [line for line in err.splitlines() if line.startswith("gdn_compat ")]
    assert len([line for line in lines if line.startswith("gdn_compat INFO")]) == 1, err[-3000:]
    [summary] = [line for line in lines if "INFO" in line]
    assert "when megatron-core was imported" in summary and "gdn_compat: " not in summary  # no doubled prefix
    assert all(name in summary for name in _needed())


@explicit
@pytest.mark.heavy
@fresh_interpreters
def test_auto_while_another_thread_imports_megatron_applies_once_that_import_is_done(fresh):
    assert _applied(fresh["thread"]) == _needed()
    assert "megatron-core was still being imported when gdn_compat's hook was installed" in fresh["thread"][2]


def test_the_doctor_says_whether_a_new_process_would_apply(monkeypatch, tmp_path):
    from gdn_compat import __main__ as doctor

    monkeypatch.setattr(site, "getsitepackages", lambda: [str(tmp_path)])
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(tmp_path / "user"))
    monkeypatch.setenv("GDN_COMPAT_AUTO", "1")
    assert doctor.auto_status() == {"variable": "1", "on": True, "pth": None, "fires": False}
    (tmp_path / "gdn_compat_auto.pth").write_text(PTH_LINE)
    assert doctor.auto_status()["fires"] is True
    assert "a new process applies gdn_compat" in doctor._auto_line(doctor.auto_status())
    monkeypatch.setenv("GDN_COMPAT_AUTO", "maybe")
    assert doctor.auto_status()["fires"] is False
    monkeypatch.delenv("GDN_COMPAT_AUTO")
    assert doctor._auto_line(doctor.auto_status()).startswith("unset; gdn_compat_auto.pth at ")


def installed_pth() -> pathlib.Path | None:
    """gdn_compat_auto.pth where site reads it: a real (wheel) install of gdn_compat in this interpreter."""
    for folder in site.getsitepackages():
        path = pathlib.Path(folder) / "gdn_compat_auto.pth"
        if path.is_file():
            return path
    return None


def run_children(*envs: dict) -> list[dict]:
    """tests/support/auto_child.py in one fresh process per environment, all at once."""
    child = [sys.executable, "-P", str(ROOT / "tests" / "support" / "auto_child.py")]
    done = run_together({i: (child, _env(**env)) for i, env in enumerate(envs)},
                        cwd=pathlib.Path(site.getsitepackages()[0]), timeout=600)
    out = []
    for code, stdout, stderr in done.values():
        assert code == 0, stderr[-3000:]
        out.append({**json.loads(stdout.strip().splitlines()[-1]), "stderr": stderr})
    return out


@pytest.mark.skipif(installed_pth() is None or not INSTALL_TESTS,
                    reason="the ray nox session runs this, from the wheel and from an editable install "
                           "(GDN_COMPAT_INSTALL_TESTS=1)")
@pytest.mark.skipif(FACTS.gdn_thd != "refuses", reason=f"megatron-core {MEGATRON} packs GDN natively")
def test_an_installed_wheel_applies_in_a_process_that_never_imports_it():
    on, off = run_children(dict(GDN_COMPAT_AUTO="1", TORCH_CUDA_ARCH_LIST="9.0"), dict(TORCH_CUDA_ARCH_LIST="9.0"))
    assert on["ok"] and on["grad_finite"] and "gdn_thd" in on["gdn_compat"]["applied"]
    editable = any(p.name.startswith("__editable__") and "gdn_compat" in p.name
                   for p in pathlib.Path(site.getsitepackages()[0]).iterdir())
    where = str(ROOT / "gdn_compat") if editable else "site-packages"  # pip install -e . hooks too (#40)
    assert where in on["gdn_compat"]["file"] and "from GDN_COMPAT_AUTO (gdn_compat_auto.pth)" in on["stderr"]
    assert not off["ok"] and off["error"].startswith("NotImplementedError") and off["gdn_compat"] is None
