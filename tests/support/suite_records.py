"""Heavy suites once per distinct megatron-core source (#23), decided by computing, never by assuming.

A test marked ``heavy`` (the full-model acceptance cells, multi-rank gloo tests, CLI subprocesses) is
skipped in a release's session only when an earlier session of the *same nox run* ran it and every
megatron-core file that session imported, in the test process and in every rank or subprocess it
started, is byte-identical in this release (``package_info.py`` compared without its version lines,
the only lines in which those files differ between patch releases). A release whose imported files
differ in one byte runs everything. nox hands each session a fresh records folder per run
(``GDN_COMPAT_SUITE_RECORDS``), so a record never outlives the code that earned it. Stdlib only.
"""

from __future__ import annotations

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


def digest(path: pathlib.Path) -> str:
    data = path.read_bytes()
    if path.name == "package_info.py":
        data = _VERSION_LINE.sub(b"", data)
    return hashlib.sha256(data).hexdigest()


def log_imports() -> None:
    """Write the megatron-core files this process imported to the records folder (no-op without it)."""
    out, root = folder(), _root()
    if out is None or root is None:
        return
    files = sorted({str(pathlib.Path(m.__file__).relative_to(root)) for m in list(sys.modules.values())
                    if getattr(m, "__file__", None) and str(m.__file__).startswith(str(root / "megatron"))})
    (out / "imports").mkdir(parents=True, exist_ok=True)
    (out / "imports" / f"{os.getpid()}.json").write_text(json.dumps(files))


def write_record(release: str) -> int:
    """After a session that ran the heavy suites: the files every process imported, with digests."""
    out, root = folder(), _root()
    assert out is not None and root is not None
    log_imports()
    files: set[str] = set()
    for part in (out / "imports").glob("*.json"):
        files.update(json.loads(part.read_text()))
        part.unlink()
    record = {"release": release, "files": {f: digest(root / f) for f in sorted(files)}}
    (out / f"{release}.json").write_text(json.dumps(record, indent=0))
    return len(files)


def earlier_identical(release: str) -> tuple[str, int] | None:
    """(release, number of files) of an earlier record whose imported files are all byte-identical here."""
    out, root = folder(), _root()
    if out is None or root is None:
        return None
    for path in sorted(out.glob("*.json")):
        record = json.loads(path.read_text())
        if record["release"] == release or not record["files"]:
            continue
        if all((root / f).is_file() and digest(root / f) == d for f, d in record["files"].items()):
            return record["release"], len(record["files"])
    return None
