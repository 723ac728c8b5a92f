"""The patch machinery: specs, one registry of originals, apply/revert/report.

Modelled on gevent's ``saved`` table (the first original wins), pytest's MonkeyPatch undo stack
(``__dict__`` lookups, NOTSET for inherited attributes, reverse undo) and Liger-Kernel's markers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

from gdn_compat._probe import Facts

log = logging.getLogger("gdn_compat")

Status = Literal["applied", "skipped", "failed", "reverted"]
MARKER = "__gdn_compat_patch__"
ENV_DISABLE = "GDN_COMPAT_DISABLE"


class _NotSet:
    def __repr__(self) -> str:
        return "NOTSET"


NOTSET: Any = _NotSet()


@dataclasses.dataclass(frozen=True)
class Patch:
    """One patch: ``decide(facts)`` returns None when needed, else the reason to skip;
    ``build()`` returns ``[(owner, attribute, replacement), ...]`` (replacements get marked)."""

    name: str
    target: str
    decide: Callable[[Facts], str | None]
    build: Callable[[], list[tuple[Any, str, Any]]]
    summary: str = ""


@dataclasses.dataclass(frozen=True)
class Record:
    name: str
    target: str
    status: Status
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {self.status} ({self.target}): {self.reason}"


@dataclasses.dataclass(frozen=True)
class Report:
    """What ``apply()``/``report()`` return: one record per patch, the hazards, the facts."""

    records: tuple[Record, ...]
    findings: tuple[Any, ...] = ()
    facts: Facts | None = None

    def __getitem__(self, name: str) -> Record:
        for rec in self.records:
            if rec.name == name:
                return rec
        raise KeyError(f"no patch named {name!r}; known: {[r.name for r in self.records]}")

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    @property
    def applied(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.records if r.status == "applied")


class Registry:
    """Originals (first saved wins), an undo stack, and the latest record per patch."""

    def __init__(self, patches: tuple[Patch, ...]):
        self.patches = patches
        self.lock = threading.RLock()
        self.undo: list[tuple[str, Any, str, Any]] = []  # (patch name, owner, attribute, old)
        self.originals: dict[tuple[int, str], Any] = {}
        self.records: dict[str, Record] = {}
        self._logged: set[tuple[str, str, str]] = set()

    # -- queries -------------------------------------------------------------------------
    def is_applied(self, name: str) -> bool:
        return any(entry[0] == name for entry in self.undo)

    def original(self, owner: Any, attr: str) -> Any:
        """The object gdn_compat replaced (or the current one when it replaced nothing)."""
        return self.originals.get((id(owner), attr), owner.__dict__.get(attr, NOTSET))

    # -- actions -------------------------------------------------------------------------
    def _record(self, rec: Record, level: int = logging.INFO) -> Record:
        self.records[rec.name] = rec
        key = (rec.name, rec.status, rec.reason)
        if key not in self._logged:  # one line per decision per process
            self._logged.add(key)
            log.log(level, "%s %s %s: %s", rec.name, rec.status, rec.target, rec.reason)
        return rec

    def _install(self, patch: Patch) -> str:
        pushed = 0
        try:
            for owner, attr, new in patch.build():
                old = owner.__dict__.get(attr, NOTSET)
                if getattr(old, MARKER, None) == patch.name:
                    raise RuntimeError(f"{owner.__qualname__}.{attr} already carries a gdn_compat "
                                       f"replacement from another copy of gdn_compat")
                setattr(new, MARKER, patch.name)
                setattr(owner, attr, new)
                self.originals.setdefault((id(owner), attr), old)
                self.undo.append((patch.name, owner, attr, old))
                pushed += 1
        except BaseException:
            for _ in range(pushed):  # never leave a half-applied class behind
                _, owner, attr, old = self.undo.pop()
                _restore(owner, attr, old)
            raise
        return "replaced"

    def apply(self, facts: Facts, enabled: dict[str, str | None]) -> list[Record]:
        with self.lock:
            out = []
            for patch in self.patches:
                if self.is_applied(patch.name):
                    out.append(self._record(Record(patch.name, patch.target, "applied", "already applied")))
                    continue
                if enabled.get(patch.name):
                    out.append(self._record(Record(patch.name, patch.target, "skipped", str(enabled[patch.name]))))
                    continue
                why = patch.decide(facts)
                if why is not None:
                    out.append(self._record(Record(patch.name, patch.target, "skipped", why)))
                    continue
                try:
                    self._install(patch)
                except Exception as exc:  # noqa: BLE001 - one broken patch never stops the others
                    out.append(self._record(Record(patch.name, patch.target, "failed",
                                                   f"{type(exc).__name__}: {exc}; target left unchanged"),
                                            logging.ERROR))
                    continue
                out.append(self._record(Record(patch.name, patch.target, "applied", patch.summary)))
            return out

    def revert(self, to: int = 0) -> list[Record]:
        with self.lock:
            names: list[str] = []
            while len(self.undo) > to:
                name, owner, attr, old = self.undo.pop()
                _restore(owner, attr, old)
                self.originals.pop((id(owner), attr), None)
                if name not in names:
                    names.append(name)
            out = []
            for name in names:
                target = self.records[name].target if name in self.records else name
                out.append(self._record(Record(name, target, "reverted", "original restored")))
            return out


def _restore(owner: Any, attr: str, old: Any) -> None:
    if old is NOTSET:
        delattr(owner, attr)  # it was inherited: deleting brings the base's back
    else:
        setattr(owner, attr, old)


def enabled_from(names: tuple[str, ...], switches: dict[str, bool]) -> dict[str, str | None]:
    """Merge keyword switches with ``GDN_COMPAT_DISABLE``: name -> None when enabled, else why not.
    Unknown names are errors."""
    unknown = sorted(set(switches) - set(names))
    if unknown:
        raise TypeError(f"apply() got unknown patch switch(es) {unknown}; known patches: {list(names)}")
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"apply({key}=...) expects True or False, got {value!r}")
    enabled: dict[str, str | None] = {
        name: None if switches.get(name, True) else f"disabled by apply({name}=False)" for name in names
    }
    raw = os.environ.get(ENV_DISABLE, "")
    listed = [part.strip() for part in raw.split(",") if part.strip()]
    bad = sorted(set(listed) - set(names))
    if bad:
        raise ValueError(f"{ENV_DISABLE}={raw!r} names unknown patch(es) {bad}; known patches: {list(names)}")
    for name in listed:
        enabled[name] = f"disabled by {ENV_DISABLE}={raw}"
    return enabled
