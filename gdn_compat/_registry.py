"""The patch machinery: specs, one decision function, one registry of what was replaced.

Modelled on pytest's MonkeyPatch undo stack (``__dict__`` lookups, NOTSET for inherited attributes,
reverse undo), gevent's one saved original per target, and Liger-Kernel's markers. A target is named
once, in its ``Patch``; the registry resolves it, hands the current object to ``build``, and installs.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any, Literal

from gdn_compat._probe import Facts

log = logging.getLogger("gdn_compat")

Status = Literal["applied", "would_apply", "skipped", "failed", "reverted", "left_in_place"]
MARKER = "__gdn_compat_patch__"
ENV_DISABLE = "GDN_COMPAT_DISABLE"
ENV_ENABLE = "GDN_COMPAT_ENABLE"  # opt-in patches


class _NotSet:
    def __repr__(self) -> str:
        return "NOTSET"


NOTSET: Any = _NotSet()


@dataclasses.dataclass(frozen=True)
class Target:
    """``module.Owner.attr``: the class attribute a patch replaces; ``owner=""`` for a module-level
    function that the module's own code looks up at call time."""

    module: str
    owner: str
    attr: str

    def __str__(self) -> str:
        return ".".join(filter(None, (self.module, self.owner, self.attr)))

    def resolve(self) -> tuple[Any, Any]:
        """(owner class or module, the object in its ``__dict__`` now, or NOTSET)."""
        owner: Any = importlib.import_module(self.module)
        for part in filter(None, self.owner.split(".")):
            owner = getattr(owner, part)
        return owner, owner.__dict__.get(self.attr, NOTSET)


@dataclasses.dataclass(frozen=True)
class Patch:
    """One patch. ``decide(facts)`` returns None when this release needs it, else the reason to
    skip; ``build(facts, original)`` returns the replacement for ``target``'s current object.
    ``requires`` names patches that must be applied first (else this one is skipped). An ``opt_in``
    patch is off unless ``apply(name=True)`` or ``GDN_COMPAT_ENABLE`` names it."""

    name: str
    target: Target
    decide: Callable[[Facts], str | None]
    build: Callable[[Facts, Any], Any]
    summary: str | Callable[[Facts], str]  # what it changes (or decided from the facts)
    requires: tuple[str, ...] | Callable[[Facts], tuple[str, ...]] = ()  # or decided from the facts
    opt_in: bool = False
    adds: bool = False  # the target is a method the release lacks: added, and deleted again on revert

    def says(self, facts: Facts) -> str:
        """The summary for these facts."""
        return self.summary(facts) if callable(self.summary) else self.summary


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
    """What ``apply()``/``revert()``/``report()`` return: one record per patch, the hazards, the facts."""

    records: tuple[Record, ...]
    findings: tuple[Any, ...] = ()
    facts: Facts | None = None
    summary: str = ""  # the one line apply() logs at INFO
    blocked: tuple[str, ...] = ()  # patches this release needs that something kept out (their reasons say what)

    def __str__(self) -> str:
        """The summary line, then each patch that failed or was kept out and each hazard apply() did not take away,
        with its reason: ``print(gdn_compat.apply())`` shows what happened."""
        applied = set(self.applied)
        why = by_reason([(r.name, r.reason) for r in self.records if r.name in self.blocked])
        return "\n".join([f"gdn_compat: {self.summary or f'{len(applied)} applied'}",
                          *(f"  not applied {', '.join(names)}: {reason}" for reason, names in why.items()),
                          *(f"  FAILED {r.name}: {r.reason}" for r in self.records if r.status == "failed"),
                          *(f"  {f}" for f in self.findings
                            if getattr(f, "severity", "") != "info" and getattr(f, "fixed_by", "") not in applied)])

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


def kept_out(status: str, reason: str) -> bool:
    """A patch the release needs that something kept out: a missing or unusable dependency, someone else's object on
    its target, an unknown shape (``not patched...``), or a patch it needs that was kept out."""
    return status == "skipped" and (reason.startswith("not patched")
                                    or reason.startswith("needs ") and "(not patched" in reason)


def by_reason(kept: list[tuple[str, str]]) -> dict[str, list[str]]:
    """(name, reason) of patches kept out, as reason -> names; a patch kept out because another one is reads
    "needs X (kept out too)" rather than repeating X's reason."""
    names = {n for n, _ in kept}
    out: dict[str, list[str]] = {}
    for name, reason in kept:
        need = reason[len("needs "):].split(",", 1)[0] if reason.startswith("needs ") else ""
        out.setdefault(f"needs {need}, kept out too" if need in names else reason, []).append(name)
    return out


def describe(obj: Any) -> str:
    func = getattr(obj, "__func__", obj)
    code = getattr(func, "__code__", None)
    where = f" from {code.co_filename}:{code.co_firstlineno}" if code else ""
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(obj).__name__)}{where}"


def foreign(owner: Any, attr: str, obj: Any) -> str | None:
    """None when ``obj`` is the release's own definition of ``owner.attr`` (its qualname, its code
    object's name and file are those of the module that defines ``owner``), else what is there."""
    module = isinstance(owner, types.ModuleType)
    name = f"{owner.__name__ if module else owner.__qualname__}.{attr}"
    if obj is NOTSET:  # inherited: the release's own is the base class's definition
        base = None if module else next((c for c in owner.__mro__[1:] if attr in c.__dict__), None)
        return foreign(base, attr, base.__dict__[attr]) if base else f"{name} does not exist"
    if getattr(obj, MARKER, None):
        return f"{name} already carries another gdn_compat's {getattr(obj, MARKER)} replacement"
    func = getattr(obj, "__func__", obj)
    # megatron's jit_fuser is torch.compile: its wrapper holds the release's own function (only that wrapper
    # is looked through; any other wrapper, functools.wraps or not, is someone else's object)
    func = getattr(func, "_torchdynamo_orig_callable", None) or func
    code = getattr(func, "__code__", None)
    home = getattr(owner if module else sys.modules.get(owner.__module__), "__file__", None)
    qualname = attr if module else f"{owner.__qualname__}.{attr}"
    if (code is not None and home is not None and code.co_filename == home and code.co_name == attr
            and getattr(func, "__qualname__", None) == qualname):
        return None
    return f"{name} is no longer the release's own: {describe(obj)}"


def switches_from(names: tuple[str, ...], switches: dict[str, bool],
                  opt_in: frozenset[str] = frozenset()) -> dict[str, str]:
    """Keyword switches merged with ``GDN_COMPAT_DISABLE`` / ``GDN_COMPAT_ENABLE``: name -> why it is off
    (absent when on). ``opt_in`` patches are off unless switched on. Unknown names and non-bool values
    are errors naming them."""
    unknown = sorted(set(switches) - set(names))
    if unknown:
        raise TypeError(f"apply() got unknown patch switch(es) {unknown}; known patches: {list(names)}")
    off = {}
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"apply({key}=...) expects True or False, got {value!r}")
        if not value:
            off[key] = f"disabled by apply({key}=False)"
    raw = os.environ.get(ENV_DISABLE, "")
    listed = [part.strip() for part in raw.split(",") if part.strip()]
    bad = sorted(set(listed) - set(names))
    if bad:
        raise ValueError(f"{ENV_DISABLE}={raw!r} names unknown patch(es) {bad}; known patches: {list(names)}")
    off.update({name: f"disabled by {ENV_DISABLE}={raw}" for name in listed})
    raw_on = os.environ.get(ENV_ENABLE, "")
    enabled = {part.strip() for part in raw_on.split(",") if part.strip()}
    if enabled - set(opt_in):
        raise ValueError(f"{ENV_ENABLE}={raw_on!r} names {sorted(enabled - set(opt_in))}, which are not opt-in "
                         f"patches; opt-in patches: {sorted(opt_in)}")
    for name in sorted(opt_in - enabled - {k for k, v in switches.items() if v is True} - set(off)):
        off[name] = f"opt-in, off by default: apply({name}=True) or {ENV_ENABLE}={name} turns it on"
    return off


class Registry:
    """The undo stack of installed replacements and the latest record per patch."""

    def __init__(self, patches: tuple[Patch, ...]):
        self.patches = patches
        self.lock = threading.RLock()
        self.undo: list[tuple[Patch, Any, Any, Any]] = []  # (patch, owner, old, new)
        self.records: dict[str, Record] = {}
        self._logged: set[tuple[str, str, str]] = set()

    def is_applied(self, name: str) -> bool:
        return any(entry[0].name == name for entry in self.undo)

    def decide(self, facts: Facts, off: dict[str, str], force: frozenset[str] = frozenset()) -> list[Record]:
        """What ``apply()`` would do now, for every patch in order: the one place a decision is made.
        Statuses: ``applied`` (already), ``skipped`` (with the reason), ``would_apply``."""
        out: dict[str, Record] = {}
        for patch in self.patches:
            out[patch.name] = self._decide_one(patch, facts, off, force, out)
        return list(out.values())

    def _decide_one(self, patch: Patch, facts: Facts, off: dict[str, str], force: frozenset[str],
                    earlier: dict[str, Record]) -> Record:
        def record(status: Status, reason: str) -> Record:
            return Record(patch.name, str(patch.target), status, reason)

        if self.is_applied(patch.name):
            return record("applied", "already applied")
        if patch.name in off:  # an opt-in patch this release does not need says so rather than "off"
            if patch.opt_in:
                return record("skipped", patch.decide(facts) or f"{facts.release}: {off[patch.name]}")
            return record("skipped", off[patch.name])
        for need in patch.requires(facts) if callable(patch.requires) else patch.requires:
            dep = earlier.get(need)
            if dep is None or dep.status not in ("applied", "would_apply"):
                return record("skipped", f"needs {need}, which is {dep.status if dep else 'unknown'}"
                                         + (f" ({dep.reason})" if dep else ""))
        try:
            owner, current = patch.target.resolve()
        except Exception as exc:  # noqa: BLE001 - a missing symbol is a skip, never a crash
            return record("skipped", patch.decide(facts)
                          or f"not patched: cannot resolve {patch.target}: {type(exc).__name__}: {exc}")
        if patch.adds:  # a method the release lacks: added only where it is still absent
            if hasattr(owner, patch.target.attr):
                return record("skipped", patch.decide(facts) or f"not patched: {patch.target} already exists")
            reason = patch.decide(facts)
            return record("skipped", reason) if reason else record("would_apply", patch.says(facts))
        if not hasattr(owner, patch.target.attr):  # nothing to replace: the release's own reason, no force offer
            return record("skipped", patch.decide(facts) or f"not patched: {patch.target} does not exist")
        # Our own replacement (another patch of this registry on the same target) is judged by the
        # release object underneath it; someone else's object first: the facts describe it, not the release.
        ours = {id(new): old for _, _, old, new in self.undo}
        while id(current) in ours:  # several of our patches may stack on one target
            current = ours[id(current)]
        other = foreign(owner, patch.target.attr, current)
        if other and patch.name not in force:
            return record("skipped", f"not patched: {other}; apply(force=[{patch.name!r}]) replaces it anyway")
        reason = patch.decide(facts)
        if reason is not None:
            return record("skipped", reason)
        return record("would_apply", patch.says(facts) + (f" (forced over {describe(current)})" if other else ""))

    def apply(self, facts: Facts, off: dict[str, str], force: frozenset[str] = frozenset()) -> list[Record]:
        with self.lock:
            out = []
            for rec in self.decide(facts, off, force):
                if rec.status == "would_apply":
                    rec = self._install(next(p for p in self.patches if p.name == rec.name), facts, rec)
                out.append(self._record(rec, logging.ERROR if rec.status == "failed" else logging.DEBUG))
            return out

    def _install(self, patch: Patch, facts: Facts, planned: Record) -> Record:
        owner, old = patch.target.resolve()
        try:  # the one setattr on the owner comes last: a failure before it changes nothing
            new = patch.build(facts, old)
            setattr(new, MARKER, patch.name)
            setattr(owner, patch.target.attr, new)
        except Exception as exc:  # noqa: BLE001 - one broken patch never stops the others
            return dataclasses.replace(planned, status="failed",
                                       reason=f"{type(exc).__name__}: {exc}; target left unchanged")
        self.undo.append((patch, owner, old, new))
        return dataclasses.replace(planned, status="applied")

    def revert(self, to: int = 0) -> list[Record]:
        """Undo newest first down to ``to``; a replacement someone else replaced since is left alone."""
        with self.lock:
            out: list[Record] = []
            while len(self.undo) > to:
                patch, owner, old, new = self.undo.pop()
                attr, name, target = patch.target.attr, patch.name, str(patch.target)
                now = owner.__dict__.get(attr, NOTSET)
                if now is new:
                    _restore(owner, attr, old)
                    rec = Record(name, target, "reverted", "original restored")
                elif patch.adds:  # nothing of ours is underneath what is there now
                    rec = Record(name, target, "left_in_place", f"replaced after apply by {describe(now)}; "
                                 f"gdn_compat's added {attr} is no longer there, and what replaced it stays")
                else:
                    rec = Record(name, target, "left_in_place", f"replaced after apply by {describe(now)}; "
                                 f"gdn_compat's replacement stays underneath it")
                out.append(self._record(rec, logging.DEBUG if now is new else logging.WARNING))
            return out

    def _record(self, rec: Record, level: int) -> Record:
        self.records[rec.name] = rec
        key = (rec.name, rec.status, rec.reason)
        if key not in self._logged:  # one line per decision per process
            self._logged.add(key)
            log.log(level, "%s %s %s: %s", rec.name, rec.status, rec.target, rec.reason)
        return rec


def _restore(owner: Any, attr: str, old: Any) -> None:
    if old is NOTSET:
        delattr(owner, attr)  # it was inherited: deleting brings the base's back
    else:
        setattr(owner, attr, old)
