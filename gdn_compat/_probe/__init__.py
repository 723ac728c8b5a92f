"""Read-only facts about the installed stack, found by inspection, never by version strings.

``probe()`` never raises and changes nothing. Every question it cannot answer gets the value
``UNKNOWN`` and a line in ``Facts.notes`` saying why. Patch decisions read these shapes; versions are
kept for messages, and only the kernel-stack hazards (``hazards.py``) compare them.

One module per subject: ``facts`` (the record and its helpers), ``gdn``, ``mtp``, ``config`` (config and
finalize), ``fla``, ``flashqla``, ``gpu``; this package runs them in order. A new patch's probe goes beside its
subject, and its fact into ``Facts``.
"""

from __future__ import annotations

import importlib
import platform
import sys
from typing import Any

from gdn_compat._probe.config import _probe_config, _probe_finalize
from gdn_compat._probe.facts import (
    CONFIG_MODULE,
    FINALIZE_MODULE,
    GDN_MODULE,
    MTP_MODULE,
    Accepts,
    Conv,
    Cp,
    Dist,
    Facts,
    Gpu,
    Layout,
    Mtp,
    Roll,
    Thd,
    Varlen,
    _dist,
    _why,
    accepts,
)
from gdn_compat._probe.fla import (
    _WY_GUARD,
    FLA_FIX,
    INNER_BWD,
    INNER_FWD,
    ZERO_LENGTH_CHUNKS,
    ZERO_LENGTH_PACK,
    _probe_fla,
    atomic_free,
    fla_problem,
    zero_length,
)
from gdn_compat._probe.flashqla import FLASHQLA_METADATA, _flashqla_metadata, _probe_flashqla
from gdn_compat._probe.gdn import GDN_LEGACY_PARAMS, GDN_NATIVE_PARAMS, _probe_gdn
from gdn_compat._probe.gpu import _probe_gpu
from gdn_compat._probe.mtp import _probe_mtp

__all__ = ["CONFIG_MODULE", "FINALIZE_MODULE", "FLA_FIX", "FLASHQLA_METADATA", "GDN_LEGACY_PARAMS", "GDN_MODULE",
           "GDN_NATIVE_PARAMS", "INNER_BWD", "INNER_FWD", "MTP_MODULE", "ZERO_LENGTH_CHUNKS", "ZERO_LENGTH_PACK",
           "Accepts", "Conv", "Cp", "Dist", "Facts", "Gpu", "Layout", "Mtp", "Roll", "Thd", "Varlen", "_WY_GUARD",
           "_flashqla_metadata", "accepts", "atomic_free", "fla_problem", "package_version", "probe", "zero_length"]


def probe(*, init_cuda: bool = False) -> Facts:
    """Inspect the installed stack now. Imports megatron-core and fla modules; changes nothing (a GDN_COMPAT_AUTO hook
    does not fire inside it: it would patch the classes being read)."""
    hook = sys.modules.get("_gdn_compat_auto")  # loaded only where GDN_COMPAT_AUTO asked for it
    if hook is None:
        return _probe_all(init_cuda)
    with hook.suspended():
        return _probe_all(init_cuda)


def _probe_all(init_cuda: bool) -> Facts:
    out: dict[str, Any] = {"python": platform.python_version(), "notes": {}}
    for key, names in (("triton", ("triton", "pytorch-triton")), ("tilelang", ("tilelang",))):
        found = _dist(*names)
        out[key] = found.version if found else None
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        out["notes"]["torch"] = f"torch failed to import ({_why(exc)})"
        return _facts(out)
    out["torch"] = torch.__version__
    out["rocm"] = getattr(torch.version, "hip", None)
    _probe_gpu(out, torch, init_cuda)
    _probe_fla(out)
    _probe_flashqla(out)
    out["megatron"] = _dist("megatron-core", "megatron_core")
    try:
        import megatron.core as mcore
    except ModuleNotFoundError:
        return _facts(out)
    except Exception as exc:  # noqa: BLE001
        for field in ("gdn", "gdn_thd", "gdn_cp", "mtp", "mtp_roll"):
            out[field] = "unknown"
            out["notes"][field] = f"megatron.core failed to import: {_why(exc)}"
        return _facts(out)
    path = str(mcore.__file__).rsplit("/", 1)[0]
    found = out["megatron"] or Dist("megatron-core", "unknown")
    try:  # the imported tree's own version: a source tree on the path may not be the installed distribution
        imported = package_version(importlib.import_module("megatron.core.package_info"))
    except Exception:  # noqa: BLE001 - no package_info: keep the metadata's
        imported = found.version
    if imported != found.version:
        out["notes"]["megatron"] = (f"the imported megatron.core ({path}) is {imported}; the installed "
                                    f"distribution's metadata says {found.version}")
    out["megatron"] = Dist(found.name, imported, path)
    _probe_gdn(out)
    if out.get("gdn") in (Layout.MODULE, Layout.PACKAGE):
        _probe_finalize(out)
    _probe_config(out)
    _probe_mtp(out)
    return _facts(out)


def package_version(info: Any) -> str:
    """megatron.core.package_info's release version, from its VERSION tuple: its ``__version__`` from 0.18 on
    appends ``+<git sha>`` of whatever git checkout the installed files sit in (a venv inside a project's repo
    gets the project's sha)."""
    version = getattr(info, "VERSION", None)
    if isinstance(version, tuple) and len(version) >= 3:
        return ".".join(map(str, version[:3])) + "".join(map(str, version[3:]))
    return str(info.__version__)


def _facts(out: dict[str, Any]) -> Facts:
    enums = {"gdn": Layout, "gdn_thd": Thd, "gdn_cp": Cp, "gdn_conv": Conv, "mtp": Mtp, "mtp_roll": Roll,
             "gdn_init_cp_comm_type": Accepts, "gdn_backward_dw": Accepts, "gdn_out_norm_tp_sum": Accepts, "gdn_thd_deterministic": Accepts,
             "fla_atomic_free": Accepts, "fla_zero_length": Accepts, "fla_blackwell_wy_guard": Accepts, "fla_flashqla_backend": Accepts,
             "gdn_gate_compiled": Accepts,
             "flashqla_atomic_free": Accepts, "flashqla_metadata": Accepts}
    for field, kind in enums.items():
        if field in out:
            out[field] = kind(out[field])
    return Facts(**out)
