"""Every command and snippet of the README works, and every line the docs quote is one the code can write (#54 item 5).

The README's fenced blocks: ``python`` blocks run in a fresh process; ``bash`` lines are run where they can run on the
CPU here (the doctor), checked by the test that runs them (the demo: tests/test_demo.py) or checked for existence
where they install or start something (a pip target, a nox session, CI's command, a path). Quoted output (``text``
and ``log`` blocks of the README, ``log`` blocks of docs/) must match a string the code can produce: each string
expression in gdn_compat's source (f-strings, concatenations, conditionals, %-formats) is turned into a regular
expression, its computed parts as wildcards.
"""

from __future__ import annotations

import ast
import builtins
import os
import pathlib
import re
import shlex
import sys

import pytest

from tests.support.processes import run_together
from tests.support.release import FACTS

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
ANY = ".*?"


def blocks(text: str, *langs: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in langs]


def commands() -> list[str]:
    """Each command line of the README's bash blocks, without its comment."""
    out = []
    for body in blocks(README, "bash"):
        for line in body.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line:
                out.append(line)
    return out


# ---- strings the code can produce, as regular expressions ----

_PERCENT = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfi]")


def _literal(text: str) -> tuple[str, int]:
    parts = _PERCENT.split(text)
    return ANY.join(re.escape(part) for part in parts), sum(map(len, parts))


def _rx(node: ast.AST) -> tuple[str, int] | None:
    """(a regex for the strings ``node`` can evaluate to, how many literal characters every such string has); None
    when it is not a string expression."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _literal(node.value)
    if isinstance(node, ast.JoinedStr):
        parts, size = [], 0
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(re.escape(str(v.value)))
                size += len(str(v.value))
                continue
            # a FormattedValue: a string expression inside it keeps its shape, anything else is a wildcard
            inner = _rx(v.value) if isinstance(v, ast.FormattedValue) and v.format_spec is None else None
            parts.append(f"(?:{inner[0]})" if inner else ANY)
            size += inner[1] if inner else 0
        return "".join(parts), size
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _rx(node.left), _rx(node.right)
        if left is None and right is None:
            return None
        left, right = left or (ANY, 0), right or (ANY, 0)
        return left[0] + right[0], left[1] + right[1]
    if isinstance(node, ast.IfExp):
        a, b = _rx(node.body), _rx(node.orelse)
        if a is None and b is None:
            return None
        a, b = a or (ANY, 0), b or (ANY, 0)
        return f"(?:{a[0]}|{b[0]})", min(a[1], b[1])
    return None


def _sources() -> list[pathlib.Path]:
    return [*sorted((ROOT / "gdn_compat").rglob("*.py")), ROOT / "_gdn_compat_auto.py"]


def code_strings() -> list[tuple[re.Pattern, int]]:
    """Every outermost string expression of the runtime code with at least 12 literal characters in every string it
    can produce, compiled, with that count."""
    found = set()
    for path in _sources():
        tree = ast.parse(path.read_text())
        inner = {id(child) for node in ast.walk(tree) if isinstance(node, (ast.BinOp, ast.IfExp, ast.JoinedStr))
                 for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if id(node) in inner:
                continue
            rx = _rx(node)
            if rx and rx[1] >= 12:
                found.add(rx)
    return [(re.compile(rx, re.S), size) for rx, size in found]


PATTERNS = code_strings()
# what a quoted line may begin with besides the message: the GDN_COMPAT_LOG handler's format
# ("%(name)s %(levelname)s: %(message)s", _gdn_compat_auto.configure_logging) and Report.__str__'s "gdn_compat: "
PREFIX = re.compile(r"^gdn_compat (?:DEBUG|INFO|WARNING|ERROR): |^gdn_compat: ")


def code_can_write(line: str) -> bool:
    """``line`` is a string of the code: one pattern matches it whole, with at least a quarter of it literal text
    (``f"megatron-core {version}"`` matches any line that starts so, and proves nothing)."""
    message = PREFIX.sub("", line)
    return any(size >= len(message) / 4 and p.fullmatch(message) for p, size in PATTERNS)


def quoted_lines() -> list[tuple[str, str]]:
    out = [("README.md", line) for body in blocks(README, "text", "log") for line in body.splitlines() if line]
    for path in sorted((ROOT / "docs").glob("*.md")):
        out += [(f"docs/{path.name}", line) for body in blocks(path.read_text(), "log")
                for line in body.splitlines() if line]
    return out


@pytest.mark.parametrize("where,line", quoted_lines(), ids=lambda x: x[:60] if isinstance(x, str) else x)
def test_each_quoted_line_is_one_the_code_can_write(where, line):
    assert code_can_write(line), f"{where} quotes a line no string of gdn_compat's code can produce:\n{line}"


def test_a_line_the_code_never_writes_is_caught():
    """The quotes #54 found: docs/frameworks.md's, and the README's summary line before its wording changed."""
    assert quoted_lines(), "the README quotes no output at all"
    assert not code_can_write("gdn_compat INFO: applied from GDN_COMPAT_AUTO (gdn_compat_auto.pth) when megatron-core "
                              "was imported: gdn_thd, config_gdn_cp")
    assert not code_can_write("gdn_compat INFO: megatron-core 0.17.1: applied gdn_thd, config_gdn_cp; 10 skipped "
                              "(python -m gdn_compat, or GDN_COMPAT_LOG=debug, says why)")
    assert code_can_write("gdn_compat INFO: megatron-core 0.17.1: applied gdn_thd; NOT applied config_gdn_cp "
                          "(print(gdn_compat.report()) says why); 3 not needed here or off (python -m gdn_compat "
                          "--verbose says why)")


# ---- commands ----

def _nox_sessions() -> dict[str, set[str]]:
    """Session name -> its parametrize ids (empty when not parametrized), read from the noxfile."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    consts: dict = {}
    for node in tree.body:  # module-level names made of literals and builtins (RELEASES, a sorted copy of it, ...)
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            try:
                value = eval(compile(ast.Expression(node.value), "noxfile.py", "eval"), {"__builtins__": builtins}, consts)
            except Exception:  # noqa: BLE001 - a name that needs nox or the machine: not a parameter list
                continue
            consts.update({t.id: value for t in node.targets})
    out = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        decos = [d for d in fn.decorator_list if isinstance(d, ast.Call) and ast.unparse(d.func).startswith("nox.")]
        session = next((d for d in decos if ast.unparse(d.func) == "nox.session"), None)
        if session is None:
            continue
        name = next((ast.literal_eval(k.value) for k in session.keywords if k.arg == "name"), fn.name)
        ids: set[str] = set()
        for d in decos:
            if ast.unparse(d.func) == "nox.parametrize":
                kw = {k.arg: k.value for k in d.keywords}
                node = kw.get("ids", d.args[1] if len(d.args) > 1 else None)
                ids |= set(eval(compile(ast.Expression(node), "noxfile.py", "eval"), {"__builtins__": builtins}, consts))
        out[name] = ids
    return out


def _extras() -> dict[str, list[str]]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return {m.group(1): re.findall(r'"([^"]+)"', m.group(2)) for m in re.finditer(r"^(\w+) = \[(.*?)\]", section, re.M)}


def _check_pip(args: list[str]) -> None:
    fla = [req for req in _extras()["fla"]]
    for target in args:
        if target == ".":
            assert (ROOT / "pyproject.toml").is_file()
        elif m := re.fullmatch(r"\.\[(\w+)\]", target):
            assert m.group(1) in _extras(), f"pip install {target}: pyproject.toml has no extra {m.group(1)!r}"
        else:  # a prerequisite: the package the fla extra names
            name = re.split(r"[=<>!]", target, maxsplit=1)[0]
            assert name in {re.split(r"[=<>!]", r, maxsplit=1)[0] for r in fla}, f"pip install {target}: unknown"


def test_every_bash_line_of_the_readme_is_checked_or_run():
    """Each line is recognised and checked here; the doctor's command lines run in the fresh-process test below."""
    sessions = _nox_sessions()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert commands(), "the README has no commands"
    for line in commands():
        words = shlex.split(line)
        if line.startswith("python3 -m pip install nox uv"):
            assert line == ci, f"the README's test command is not CI's ({ci!r}): {line!r}"
        elif words[:2] == ["pip", "install"]:
            _check_pip(words[2:])
        elif words[:2] == ["nox", "-s"]:
            name, _, param = words[2].partition("(")
            assert name in sessions, f"{line}: no nox session {name!r} (sessions: {sorted(sessions)})"
            assert not param or param.rstrip(")") in sessions[name], f"{line}: {name} has no parameter {param}"
        elif words[:3] == ["python", "-m", "pytest"]:
            assert (ROOT / words[-1]).exists(), line
        elif words[:3] == ["python", "-m", "gdn_compat.demo"]:
            from tests.test_demo import DEMO

            assert words[1:] == DEMO, "tests/test_demo.py runs the demo with another command line"
        else:
            pytest.fail(f"a README command this test does not know how to check: {line!r}")


def test_every_environment_variable_the_readme_names_exists():
    names = set(re.findall(r"\bGDN_COMPAT_[A-Z]+\b", README))
    code = "".join(p.read_text() for p in _sources())
    assert names and {n for n in names if n not in code} == set()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """The README's python blocks and its doctor command in fresh processes (outside the checkout), together."""
    away = tmp_path_factory.mktemp("readme")
    env = {**os.environ, "PYTHONWARNINGS": "default"}  # the doctor must keep third-party warnings out by itself
    env.pop("PYTHONPATH", None)
    runs = {f"snippet {i}": [sys.executable, "-c", code] for i, code in enumerate(blocks(README, "python"))}
    runs["doctor"] = [sys.executable, "-m", "gdn_compat"]
    return run_together({k: (cmd, env) for k, cmd in runs.items()}, cwd=away)


@pytest.mark.heavy
def test_the_readme_python_snippets_run_and_print_what_was_applied(fresh):
    snippets = {k: v for k, v in fresh.items() if k.startswith("snippet")}
    assert snippets, "the README has no python block"
    for name, (code, out, err) in snippets.items():
        assert code == 0, f"{name}: {err[-3000:]}"
        first = out.splitlines()[0]
        assert first.startswith(f"gdn_compat: {FACTS.release}: "), first
        assert code_can_write(first)
        if FACTS.megatron and FACTS.megatron.version == "0.17.1":  # the README quotes 0.17.1's line
            assert first in blocks(README, "text")[0].splitlines(), f"the README's quoted line is not 0.17.1's:\n{first}"


@pytest.mark.heavy
def test_the_doctor_command_prints_a_short_report_and_nobody_elses_warnings(fresh):
    code, out, err = fresh["doctor"]
    assert code in (0, 1), err[-3000:]
    lines = out.splitlines()
    assert len(lines) <= 25 and "verdict: " in lines[0], out
    assert "Warning" not in err and "warnings.warn" not in err, err[-2000:]


@pytest.mark.parametrize("args", [[], ["--verbose"], ["--json"]], ids=["default", "verbose", "json"])
def test_the_doctor_flags_the_readme_and_docs_name_run(args, capsys):
    from gdn_compat.__main__ import main

    named = set(re.findall(r"python -m gdn_compat((?: --[\w-]+)*)", README + (ROOT / "docs/doctor.md").read_text()))
    assert " ".join(args) in {n.strip() for n in named}, f"python -m gdn_compat {' '.join(args)} is not documented"
    code = main(args)
    assert code in (0, 1) and capsys.readouterr().out.strip()
