"""gdn_compat: patches the holes of released megatron-core for Gated DeltaNet training.

    import gdn_compat
    gdn_compat.apply()      # before the model is built

``import gdn_compat`` probes the installed stack (read-only). ``apply()`` patches exactly what this
release lacks, logs each decision once on the ``gdn_compat`` logger, and returns a ``Report``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from gdn_compat._probe import Facts, probe
from gdn_compat._registry import Record, Registry, Report, enabled_from
from gdn_compat.hazards import Finding, check
from gdn_compat.patches import PATCHES

__version__ = "0.1.0"
__all__ = ["Facts", "Finding", "Record", "Report", "apply", "applied", "facts", "plan", "report", "revert"]

log = logging.getLogger("gdn_compat")
facts: Facts = probe()
_registry = Registry(PATCHES)
_warned: set[Finding] = set()


def apply(**switches: bool) -> Report:
    """Apply every patch this megatron-core needs, once. ``apply(gdn_thd=False)`` or
    ``GDN_COMPAT_DISABLE=gdn_thd,mtp_padding_mask`` turns patches off. Thread-safe, idempotent."""
    enabled = enabled_from(tuple(p.name for p in PATCHES), switches)
    _registry.apply(facts, enabled)
    result = report()
    for finding in result.findings:  # after the patch decisions, once per process
        if finding.severity != "info" and finding not in _warned:
            _warned.add(finding)
            log.warning("%s", finding)
    return result


def revert() -> Report:
    """Restore every original object (identity), newest first. Harmless when nothing is applied."""
    _registry.revert()
    return report()


def report() -> Report:
    """The latest decision for every patch that ``apply()`` or ``revert()`` has seen."""
    records = tuple(_registry.records[p.name] for p in PATCHES if p.name in _registry.records)
    return Report(records=records, findings=tuple(check(facts)), facts=facts)


def plan(for_facts: Facts | None = None) -> list[Record]:
    """What ``apply()`` would decide for each patch, without changing anything (used by the doctor)."""
    use = for_facts or facts
    out = []
    enabled = enabled_from(tuple(p.name for p in PATCHES), {})
    for patch in PATCHES:
        why = enabled[patch.name] or patch.decide(use)
        if why:
            out.append(Record(patch.name, patch.target, "skipped", why))
        else:
            out.append(Record(patch.name, patch.target, "applied", f"would apply: {patch.summary}"))
    return out


@contextlib.contextmanager
def applied(**switches: bool) -> Iterator[Report]:
    """``with gdn_compat.applied(): ...`` applies, then reverts what this block applied."""
    mark = len(_registry.undo)
    try:
        yield apply(**switches)
    finally:
        _registry.revert(to=mark)

