"""Heavy suites once per distinct megatron-core source (#23), decided by computing, never by assuming.

A test marked ``heavy`` (the full-model acceptance cells, multi-rank gloo tests, CLI subprocesses) is
skipped in a release's session only when an earlier session of the *same nox run* ran it and every
megatron-core file that session imported, in the test process and in every rank or subprocess it
started, is byte-identical in this release (``package_info.py`` compared without its version lines,
the only lines in which those files differ between patch releases), every gdn_compat and test file it
imported is byte-identical too, and the same distributions are installed at the same versions. A release
whose imported files differ in one byte, or whose venv holds another version of any package, runs everything. nox hands each session a fresh records folder per run
(``GDN_COMPAT_SUITE_RECORDS``), so a record never outlives the code that earned it. nox runs each minor's newest
patch release first (#55): the newest runs the heavy suites, an older patch release only where its files differ from
every release that ran them before it. Stdlib only.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pathlib
import re
import sys

ENV = "GDN_COMPAT_SUITE_RECORDS"
_VERSION_LINE = re.compile(rb"^(MAJOR|MINOR|PATCH|PRE_RELEASE|DEV)\s*=.*$", re.M)


def folder() -> pathlib.Path | None:
    path = os.environ.get(ENV)
    return pathlib.Path(path) if path else None


def _root() -> pathlib.Path | None:
    import importlib.util

    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0]).parent


def release() -> str | None:
    """The megatron-core version its ``package_info.py`` states (as ``tests.support.release.MEGATRON`` reads it),
    read from the file: the pytest-xdist controller names records without importing megatron-core (~6 s)."""
    root = _root()
    info = root / "megatron" / "core" / "package_info.py" if root else None
    if info is None or not info.is_file():
        return None
    fields = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*(.+?)\s*$", info.read_text(), re.M))
    try:
        major, minor, patch = (ast.literal_eval(fields[k]) for k in ("MAJOR", "MINOR", "PATCH"))
        pre = ast.literal_eval(fields.get("PRE_RELEASE", "''"))
    except (KeyError, ValueError, SyntaxError):
        return None
    return f"{major}.{minor}.{patch}{pre}"


def digest(path: pathlib.Path) -> str:
    data = path.read_bytes()
    if path.name == "package_info.py":
        data = _VERSION_LINE.sub(b"", data)
    return hashlib.sha256(data).hexdigest()


def _project() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parents[2]


def _dists() -> dict[str, str]:
    """Every distribution installed in this environment but megatron-core (which differs between sessions by design):
    name -> version. Read from site-packages, not ``sys.path``: importing torch's cpp_extension (setuptools) puts
    setuptools' vendored packages on the path (an older ``packaging`` among them), and a session's processes need not
    have imported the same modules when they compare."""
    import importlib.metadata as md
    import sysconfig

    out = {}
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    for dist in md.distributions(path=paths):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name and name != "megatron-core":
            out[name] = dist.version
    return out


def log_imports() -> None:
    """Write the megatron-core and project (gdn_compat, tests) files this process imported to the records folder
    (no-op without it)."""
    out, root = folder(), _root()
    if out is None or root is None:
        return
    project = _project()
    mods = [pathlib.Path(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", None)]
    files = sorted({str(p.relative_to(root)) for p in mods if str(p).startswith(str(root / "megatron"))})
    own = sorted({str(p.resolve().relative_to(project)) for p in mods
                  if str(p.resolve()).startswith(str(project / "gdn_compat")) or str(p.resolve()).startswith(str(project / "tests"))})
    (out / "imports").mkdir(parents=True, exist_ok=True)
    (out / "imports" / f"{os.getpid()}.json").write_text(json.dumps({"megatron": files, "project": own}))


def write_record(release: str) -> int:
    """After a session that ran the heavy suites: the files every process imported, with digests, and the
    installed distributions' versions."""
    out, root = folder(), _root()
    assert out is not None and root is not None
    log_imports()
    files: set[str] = set()
    own: set[str] = set()
    for part in (out / "imports").glob("*.json"):
        logged = json.loads(part.read_text())
        files.update(logged["megatron"])
        own.update(logged["project"])
        part.unlink()
    project = _project()
    record = {"release": release, "files": {f: digest(root / f) for f in sorted(files)},
              "project": {f: digest(project / f) for f in sorted(own)}, "dists": _dists()}
    (out / f"{release}.json").write_text(json.dumps(record, indent=0))
    return len(files)


def earlier_identical(release: str) -> tuple[str, int] | None:
    """(release, number of megatron-core files) of an earlier record whose imported files (megatron-core's and
    the project's) are all byte-identical here, with the same distributions installed at the same versions."""
    out, root = folder(), _root()
    if out is None or root is None:
        return None
    project, dists = _project(), _dists()
    for path in sorted(out.glob("*.json")):
        record = json.loads(path.read_text())
        if record["release"] == release or not record["files"]:
            continue
        same_release = all((root / f).is_file() and digest(root / f) == d for f, d in record["files"].items())
        same_project = all((project / f).is_file() and digest(project / f) == d
                           for f, d in record.get("project", {}).items())
        if same_release and same_project and record.get("dists") == dists:
            return record["release"], len(record["files"])
    return None
