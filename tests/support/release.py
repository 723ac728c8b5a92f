"""The megatron-core release under test: its version, its probe before any apply(), its plan."""

from __future__ import annotations

import importlib.metadata as md


def megatron_version() -> str | None:
    """The imported megatron.core's own version (a source tree on PYTHONPATH wins over the installed wheel)."""
    try:
        md.version("megatron-core")
    except md.PackageNotFoundError:
        return None
    from megatron.core import package_info

    from gdn_compat._probe import package_version

    return package_version(package_info)


MEGATRON = megatron_version()


def _facts():
    import gdn_compat

    return gdn_compat.probe()


FACTS = _facts()  # the release as installed, before any apply()


def skip_reason(patch: str, **switches: bool) -> str | None:
    """None when ``apply(**switches)`` would apply ``patch`` on this release, else the plan's reason to skip."""
    import gdn_compat

    [rec] = [r for r in gdn_compat.plan(FACTS, **switches) if r.name == patch]
    return None if rec.status == "would_apply" else f"{patch} not applied on megatron-core {MEGATRON}: {rec.reason}"
