"""gdn_compat: patches the holes of released megatron-core for Gated DeltaNet training.

    import gdn_compat
    gdn_compat.apply()      # before the model is built

``apply()`` probes the installed stack *now* (signatures and source shapes, never version strings),
patches exactly what this release lacks, logs each decision once on the ``gdn_compat`` logger, and
returns a ``Report``. Importing gdn_compat changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from gdn_compat import _probe, graphs
from gdn_compat._probe import Facts
from gdn_compat._registry import Record, Registry, Report, kept_out, switches_from
from gdn_compat.hazards import Finding, check
from gdn_compat.patches import PATCHES

__version__ = "0.1.0"
__all__ = ["Facts", "Finding", "Record", "Report", "apply", "applied", "auto", "graphs", "plan", "probe", "report",
           "revert"]

log = logging.getLogger("gdn_compat")
_NAMES = tuple(p.name for p in PATCHES)
_OPT_IN = frozenset(p.name for p in PATCHES if p.opt_in)
_registry = Registry(PATCHES)
_warned: set[Finding] = set()
_warned_switches: set[tuple[str, str, str]] = set()
_said: set[str] = set()  # summary lines, once per process
_quiet: set[str] = set()  # opt-in patches the latest apply() was not asked for: never "not applied"
_from_hook: dict[str, Any] = {"mark": None, "source": None}  # where the GDN_COMPAT_AUTO hook's patches begin


def _OPT_IN_OFF(off: dict[str, str]) -> set[str]:
    """Opt-in patches that are off only because nobody switched them on (no warning for those)."""
    return {n for n in _OPT_IN if off.get(n, "").startswith("opt-in, off by default")}


def apply(*, force: Iterable[str] = (), **switches: bool) -> Report:
    """Apply every patch this megatron-core needs, once, in a fixed order. ``apply(gdn_thd=False)`` or
    ``GDN_COMPAT_DISABLE=gdn_thd,...`` turns patches off; opt-in patches are on only with
    ``apply(gdn_thd_graph_safe=True)`` or ``GDN_COMPAT_ENABLE=gdn_thd_graph_safe``. ``GDN_COMPAT_DISABLE`` wins over
    both (a kill switch that needs no code change); ``apply(x=False)`` wins over ``GDN_COMPAT_ENABLE``. A switch
    does not undo a patch applied earlier in the process (a warning says so): ``revert()`` does. A target that is
    no longer the release's own object (another library replaced it) is skipped with the reason, unless named in
    ``force``. Thread-safe, idempotent. Logs one summary line at INFO (each decision at DEBUG); with
    ``GDN_COMPAT_AUTO`` set, this call decides, not the variable (``_gdn_compat_auto``)."""
    _explicit("apply()")
    return _apply(force, switches, None)


def _apply_from_hook(source: str) -> Report:
    """``GDN_COMPAT_AUTO``'s apply (``_gdn_compat_auto``): no switches; remembered, so that a later ``apply(...)`` with
    switches replaces it (explicit code wins over the environment)."""
    with _registry.lock:
        mark = len(_registry.undo)
        result = _apply((), {}, source)
        _from_hook.update(mark=mark, source=source)
    return result


def _apply(force: Iterable[str], switches: dict[str, bool], source: str | None) -> Report:
    forced = _forced(force)
    off = switches_from(_NAMES, switches, _OPT_IN)  # bad switches fail before anything changes
    with _registry.lock:
        mark = _from_hook["mark"]
        if source is None and mark is not None and (switches or forced):
            _from_hook["mark"] = None
            log.info("gdn_compat.apply(%s) decides over GDN_COMPAT_AUTO, which applied at the import of megatron-core "
                     "(%s): its patches are reverted and these switches applied", _call(forced, switches),
                     _from_hook["source"])
            _registry.revert(to=mark)
    facts = probe()  # looked up at call time (tests hand apply() other facts through it)
    for name in sorted(set(off) & {n for n in _NAMES if _registry.is_applied(n)} - set(_OPT_IN_OFF(off))):
        if ("switched-off", name, off[name]) not in _warned_switches:  # once per process and switch
            _warned_switches.add(("switched-off", name, off[name]))
            log.warning("%s is already applied in this process; %s does not undo it: gdn_compat.revert() (or the "
                        "gdn_compat.applied() context) does", name, off[name])
    _registry.apply(facts, off, forced)
    _quiet.clear()
    _quiet.update(_OPT_IN_OFF(off))
    result = _report(facts, source)
    if result.summary not in _said:  # once per process
        _said.add(result.summary)
        failed = any(r.status == "failed" for r in result)
        log.log(logging.ERROR if failed else logging.INFO, "%s", result.summary)
    for finding in result.findings:  # after the patch decisions, once per process
        if finding.severity != "info" and finding not in _warned and finding.fixed_by not in result.applied:
            _warned.add(finding)
            log.warning("%s", finding)
    return result


def _call(forced: frozenset[str], switches: dict[str, bool]) -> str:
    return ", ".join([*(f"{k}={v}" for k, v in switches.items()), *([f"force={sorted(forced)}"] if forced else [])])


def _blocked(rec: Record) -> bool:
    """A patch this release needs that something kept out (``_registry.kept_out``), unless nobody asked for it."""
    return rec.name not in _quiet and kept_out(rec.status, rec.reason)


def _summary(facts: Facts, records: tuple[Record, ...], source: str | None) -> str:
    """The one INFO line of an apply(): what is applied now, what was kept out, how many are not needed here or off,
    where the call came from."""
    applied = [r.name for r in records if r.status == "applied"]
    failed = [r.name for r in records if r.status == "failed"]
    blocked = [r.name for r in records if _blocked(r)]
    rest = sum(r.status == "skipped" for r in records) - len(blocked)
    return (f"{facts.release}: {'applied ' + ', '.join(applied) if applied else 'nothing applied'}"
            + (f" (from {source}, when megatron-core was imported)" if source else "")
            + (f"; FAILED {', '.join(failed)}" if failed else "")
            + (f"; NOT applied {', '.join(blocked)} (print(gdn_compat.report()) says why)" if blocked else "")
            + f"; {rest} not needed here or off (python -m gdn_compat --verbose says why)")


def plan(facts: Facts | None = None, *, force: Iterable[str] = (), **switches: bool) -> list[Record]:
    """What ``apply()`` would decide for each patch now (status ``would_apply`` / ``skipped`` /
    ``applied`` when already applied), changing nothing (``GDN_COMPAT_AUTO`` included: it defers to this call)."""
    _explicit("plan()")
    return _registry.decide(facts or probe(), switches_from(_NAMES, switches, _OPT_IN), _forced(force))


def probe(*, init_cuda: bool = False) -> Facts:
    """Inspect the installed stack now (signatures, source shapes, a few plain-torch runs on the CPU); changes nothing.
    ``init_cuda`` also asks the GPU its name and capability (it creates a CUDA context)."""
    _explicit("probe()")
    return _probe.probe(init_cuda=init_cuda)


def revert() -> Report:
    """Restore every original object (identity), newest first; a replacement that someone else
    replaced after ``apply()`` is left in place and reported so. Harmless when nothing is applied."""
    _explicit("revert()")
    _registry.revert()
    return _report(probe())


def report() -> Report:
    """The latest decision for every patch that ``apply()`` or ``revert()`` has seen."""
    _explicit("report()")
    return _report(probe())


@contextlib.contextmanager
def applied(*, force: Iterable[str] = (), **switches: bool) -> Iterator[Report]:
    """``with gdn_compat.applied(): ...`` applies, then reverts what this block applied."""
    mark = len(_registry.undo)
    try:
        yield apply(force=force, **switches)
    finally:
        _registry.revert(to=mark)


def auto() -> None:
    """Apply as soon as megatron-core is imported in this process, or at once (with a warning) if it already is:
    for hooks that run at process start, e.g. Ray's ``runtime_env={"worker_process_setup_hook": "gdn_compat.auto"}``.
    ``GDN_COMPAT_AUTO=1`` does the same with no code at all (``_gdn_compat_auto``)."""
    _hook(load=True).install("gdn_compat.auto()", _apply_from_hook)


def _hook(load: bool = False):
    """The stdlib-only GDN_COMPAT_AUTO hook module (``_gdn_compat_auto``); loaded only where it is needed."""
    if load or "_gdn_compat_auto" in sys.modules:
        import importlib

        return importlib.import_module("_gdn_compat_auto")
    return None


def _explicit(who: str) -> None:
    """This process calls gdn_compat itself: its calls decide, not ``GDN_COMPAT_AUTO`` (see ``_gdn_compat_auto``)."""
    hook = _hook()
    if hook is not None:
        hook.decide(who)


def _forced(force: Iterable[str]) -> frozenset[str]:
    if isinstance(force, str):
        force = [force]
    names = frozenset(force)
    if names - set(_NAMES):
        raise TypeError(f"apply(force=...) names unknown patch(es) {sorted(names - set(_NAMES))}; "
                        f"known patches: {list(_NAMES)}")
    return names


def _report(facts: Facts, source: str | None = None) -> Report:
    records = tuple(_registry.records[n] for n in _NAMES if n in _registry.records)
    return Report(records=records, findings=tuple(check(facts)), facts=facts, summary=_summary(facts, records, source),
                  blocked=tuple(r.name for r in records if _blocked(r)))


def _at_import() -> None:
    """``GDN_COMPAT_LOG`` configures the logger; ``GDN_COMPAT_AUTO`` set but not seen at interpreter start (no
    gdn_compat_auto.pth ran: ``python -S``, gdn_compat on ``PYTHONPATH`` only, an editable install made before the
    ``.pth`` was part of one) is said, loudly, and the hook installed now (applying at once, with a warning, if
    megatron-core is already imported)."""
    if os.environ.get("GDN_COMPAT_LOG", "").strip():
        _hook(load=True).configure_logging()
    if os.environ.get("GDN_COMPAT_AUTO", "").strip().lower() in ("", "0", "false", "no", "off"):
        return
    hook = _hook(load=True)
    if not hook.requested() or hook._state["installed"] or hook._state["decided"]:
        return
    log.warning("GDN_COMPAT_AUTO is set, but gdn_compat_auto.pth did not run when this interpreter started (python "
                "-S, gdn_compat found through PYTHONPATH rather than installed, or an old editable install): processes "
                "that never import gdn_compat stay unpatched. `pip install .` or `pip install -e .` installs it; "
                "`python -m gdn_compat` shows whether it is there. This process hooks megatron-core now")
    hook.install("GDN_COMPAT_AUTO, seen when gdn_compat was imported", _apply_from_hook)


_at_import()
