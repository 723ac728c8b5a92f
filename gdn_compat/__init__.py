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
from collections.abc import Iterable, Iterator

from gdn_compat import graphs
from gdn_compat._probe import Facts, probe
from gdn_compat._registry import Record, Registry, Report, switches_from
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
    ``force``. Thread-safe, idempotent."""
    forced = _forced(force)
    facts = probe()
    off = switches_from(_NAMES, switches, _OPT_IN)
    for name in sorted(set(off) & {n for n in _NAMES if _registry.is_applied(n)} - set(_OPT_IN_OFF(off))):
        if ("switched-off", name, off[name]) not in _warned_switches:  # once per process and switch
            _warned_switches.add(("switched-off", name, off[name]))
            log.warning("%s is already applied in this process; %s does not undo it: gdn_compat.revert() (or the "
                        "gdn_compat.applied() context) does", name, off[name])
    _registry.apply(facts, off, forced)
    result = _report(facts)
    for finding in result.findings:  # after the patch decisions, once per process
        if finding.severity != "info" and finding not in _warned:
            _warned.add(finding)
            log.warning("%s", finding)
    return result


def plan(facts: Facts | None = None, *, force: Iterable[str] = (), **switches: bool) -> list[Record]:
    """What ``apply()`` would decide for each patch now (status ``would_apply`` / ``skipped`` /
    ``applied`` when already applied), changing nothing."""
    return _registry.decide(facts or probe(), switches_from(_NAMES, switches, _OPT_IN), _forced(force))


def revert() -> Report:
    """Restore every original object (identity), newest first; a replacement that someone else
    replaced after ``apply()`` is left in place and reported so. Harmless when nothing is applied."""
    _registry.revert()
    return report()


def report() -> Report:
    """The latest decision for every patch that ``apply()`` or ``revert()`` has seen."""
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
    import _gdn_compat_auto

    _gdn_compat_auto.install("gdn_compat.auto()")


def _forced(force: Iterable[str]) -> frozenset[str]:
    if isinstance(force, str):
        force = [force]
    names = frozenset(force)
    if names - set(_NAMES):
        raise TypeError(f"apply(force=...) names unknown patch(es) {sorted(names - set(_NAMES))}; "
                        f"known patches: {list(_NAMES)}")
    return names


def _report(facts: Facts) -> Report:
    records = tuple(_registry.records[n] for n in _NAMES if n in _registry.records)
    return Report(records=records, findings=tuple(check(facts)), facts=facts)


def _auto_at_import() -> None:
    """``GDN_COMPAT_AUTO`` set, but after interpreter start (so gdn_compat_auto.pth did not see it): importing
    gdn_compat installs the hook then (applying at once, with a warning, if megatron-core is already imported)."""
    import os

    if os.environ.get("GDN_COMPAT_AUTO", "").strip() not in ("", "0"):
        import _gdn_compat_auto

        if _gdn_compat_auto.requested():
            _gdn_compat_auto.install("GDN_COMPAT_AUTO, seen when gdn_compat was imported")


_auto_at_import()
