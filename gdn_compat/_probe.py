"""Read-only facts about the installed stack, found by inspection, never by version strings.

``probe()`` never raises: every question it cannot answer becomes ``"unknown: <why>"``.
Versions are recorded for messages only; no decision in gdn_compat compares them.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata as md
import inspect
import platform
import re
import sys
from typing import Any

GDN_MODULE = "megatron.core.ssm.gated_delta_net"
MTP_MODULE = "megatron.core.transformer.multi_token_prediction"

# The 0.16/0.17 GatedDeltaNet.forward parameters; the gdn_thd replacement has exactly these.
GDN_LEGACY_PARAMS = (
    "self", "hidden_states", "attention_mask", "key_value_states", "inference_context",
    "attention_bias", "packed_seq_params", "sequence_len_offset", "inference_params", "kwargs",
)


@dataclasses.dataclass(frozen=True)
class Facts:
    """What ``probe()`` found. Strings ``"unknown: ..."`` carry the reason a probe could not decide."""

    python: str
    torch: str | None = None
    triton: str | None = None
    cuda: str = "unknown: not probed"  # "sm_90 NVIDIA H200", "absent", or "unknown: ..."
    cuda_capability: tuple[int, int] | None = None
    megatron: str | None = None  # megatron-core version, for messages only
    megatron_path: str | None = None
    megatron_error: str | None = None
    gdn: str = "absent"  # "module <file>" | "package <dir>" | "absent" | "unknown: ..."
    gdn_thd: str = "absent"  # "native" | "refuses" | "absent" | "unknown: ..."
    gdn_legacy_shape: bool = False  # the exact 0.16/0.17 forward and helpers gdn_thd relies on
    gdn_cp: str = "absent"  # "native" | "none" | "absent" | "unknown: ..."
    gdn_conv: str = "absent"  # non-THD conv of a legacy GDN: "causal_conv1d package" | "nn.Conv1d"
    mtp: str = "absent"  # "generic" | "no_padding_mask" | "has_padding_mask" | "absent" | "unknown: ..."
    fla: str | None = None  # distribution and version, e.g. "fla-core 0.4.2"
    fla_version: str | None = None
    fla_path: str | None = None
    fla_error: str | None = None
    fla_rule_cu_seqlens: str = "absent"  # "yes" | "no" | "absent" | "unknown: ..."
    fla_rule_cu_seqlens_cpu: str = "absent"
    fla_conv_cu_seqlens: str = "absent"
    fla_conv_cu_seqlens_cpu: str = "absent"
    tilelang: str | None = None  # fla >= 0.5 can use it instead of the miscompiled Triton kernel

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _dist_version(*names: str) -> tuple[str, str] | None:
    for name in names:
        try:
            return name, md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _params(func: Any) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(func).parameters)


def _source(func: Any) -> str:
    return inspect.getsource(func)


def _accepts(func: Any, name: str) -> str:
    try:
        return "yes" if name in _params(func) else "no"
    except (TypeError, ValueError) as exc:
        return f"unknown: {_why(exc)}"


_REFUSES_THD = re.compile(
    r"if\s+packed_seq_params\s+is\s+not\s+None\s*:\s*(?:#[^\n]*\s*)*raise\s+NotImplementedError"
)


def _probe_gdn(out: dict[str, Any]) -> None:
    try:
        mod = importlib.import_module(GDN_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name and GDN_MODULE.startswith(exc.name):
            return  # this release has no GatedDeltaNet
        out["gdn"] = out["gdn_thd"] = out["gdn_cp"] = f"unknown: importing {GDN_MODULE} failed: {_why(exc)}"
        return
    except Exception as exc:  # noqa: BLE001 - a broken import is a finding, not a crash
        out["gdn"] = out["gdn_thd"] = out["gdn_cp"] = f"unknown: importing {GDN_MODULE} failed: {_why(exc)}"
        return
    cls = getattr(mod, "GatedDeltaNet", None)
    if cls is None:
        out["gdn"] = out["gdn_thd"] = out["gdn_cp"] = f"unknown: {GDN_MODULE} has no GatedDeltaNet"
        return
    where = getattr(mod, "__file__", "") or ""
    kind = "package" if where.endswith("__init__.py") else "module"
    defining = sys.modules.get(cls.__module__)
    out["gdn"] = f"{kind} {getattr(defining, '__file__', where)}"
    try:
        params = _params(cls.forward)
        src = _source(cls.forward)
        cls_src = _source(cls)
    except (TypeError, OSError, ValueError) as exc:
        out["gdn_thd"] = out["gdn_cp"] = f"unknown: cannot read GatedDeltaNet.forward: {_why(exc)}"
        return
    if "packed_seq_params" not in params:
        out["gdn_thd"] = "unknown: GatedDeltaNet.forward takes no packed_seq_params"
    elif _REFUSES_THD.search(src):
        out["gdn_thd"] = "refuses"
    elif "qkv_format" in src and "cu_seqlens" in src:
        out["gdn_thd"] = "native"
    else:
        out["gdn_thd"] = "unknown: GatedDeltaNet.forward neither refuses nor handles qkv_format='thd'"
    out["gdn_cp"] = "native" if re.search(r"pg_collection\.cp\b|cp_size", cls_src) else "none"
    out["gdn_legacy_shape"] = bool(
        tuple(params) == GDN_LEGACY_PARAMS
        and out["gdn_thd"] == "refuses"
        and callable(getattr(cls, "_apply_gated_norm", None))
        and callable(getattr(defining, "torch_chunk_gated_delta_rule", None))
        and "l2norm" in vars(defining or object)
    )
    if out["gdn_legacy_shape"]:
        has_pkg = getattr(defining, "causal_conv1d_fn", None) is not None
        out["gdn_conv"] = "causal_conv1d package" if has_pkg else "nn.Conv1d"
    else:
        out["gdn_conv"] = "fla causal_conv1d" if out["gdn_thd"] == "native" else "unknown"


_PASSES_MASK = re.compile(r"self\._checkpointed_forward\((?:[^()]|\([^()]*\))*padding_mask\s*=", re.S)


def _probe_mtp(out: dict[str, Any]) -> None:
    try:
        mod = importlib.import_module(MTP_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name and MTP_MODULE.startswith(exc.name):
            return
        out["mtp"] = f"unknown: importing {MTP_MODULE} failed: {_why(exc)}"
        return
    except Exception as exc:  # noqa: BLE001
        out["mtp"] = f"unknown: importing {MTP_MODULE} failed: {_why(exc)}"
        return
    cls = getattr(mod, "MultiTokenPredictionLayer", None)
    if cls is None or not hasattr(cls, "_checkpointed_forward"):
        out["mtp"] = "unknown: MultiTokenPredictionLayer._checkpointed_forward not found"
        return
    try:
        ckpt = _params(cls._checkpointed_forward)
        fwd_src = _source(cls.forward)
        layer = _params(cls._proj_and_transformer_layer) if hasattr(cls, "_proj_and_transformer_layer") else {}
    except (TypeError, OSError, ValueError) as exc:
        out["mtp"] = f"unknown: cannot read MultiTokenPredictionLayer: {_why(exc)}"
        return
    if "forward_func" in ckpt:
        out["mtp"] = "generic"
    elif "padding_mask" in ckpt:
        out["mtp"] = "has_padding_mask"
    elif any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ckpt.values()):
        out["mtp"] = "unknown: _checkpointed_forward takes **kwargs"
    elif not _PASSES_MASK.search(fwd_src):
        out["mtp"] = "unknown: forward does not pass padding_mask to _checkpointed_forward"
    elif "padding_mask" not in layer:
        out["mtp"] = "unknown: _proj_and_transformer_layer takes no padding_mask"
    else:
        out["mtp"] = "no_padding_mask"


def _probe_fla(out: dict[str, Any]) -> None:
    found = _dist_version("fla-core", "flash-linear-attention")
    if found:
        out["fla"] = f"{found[0]} {found[1]}"
        out["fla_version"] = found[1]
    try:
        rule_mod = importlib.import_module("fla.ops.gated_delta_rule")
        conv_mod = importlib.import_module("fla.modules.convolution")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "fla":
            return
        out["fla_error"] = _why(exc)
    except Exception as exc:  # noqa: BLE001 - e.g. fla 0.4.x with Triton >= 3.7 raises ValueError
        out["fla_error"] = _why(exc)
    else:
        out["fla_path"] = getattr(sys.modules.get("fla"), "__file__", None)
        rule = getattr(rule_mod, "chunk_gated_delta_rule", None)
        conv = getattr(conv_mod, "causal_conv1d", None)
        for key, func, arg in (
            ("fla_rule_cu_seqlens", rule, "cu_seqlens"),
            ("fla_rule_cu_seqlens_cpu", rule, "cu_seqlens_cpu"),
            ("fla_conv_cu_seqlens", conv, "cu_seqlens"),
            ("fla_conv_cu_seqlens_cpu", conv, "cu_seqlens_cpu"),
        ):
            out[key] = _accepts(func, arg) if func is not None else "absent"
        return
    for key in ("fla_rule_cu_seqlens", "fla_rule_cu_seqlens_cpu", "fla_conv_cu_seqlens", "fla_conv_cu_seqlens_cpu"):
        out[key] = f"unknown: fla failed to import ({out['fla_error']})"


def _probe_cuda(out: dict[str, Any], torch: Any, init_cuda: bool) -> None:
    try:
        if not torch.cuda.is_available():
            out["cuda"] = "absent"
            return
        if not (init_cuda or torch.cuda.is_initialized()):
            # Asking for the capability creates a CUDA context; before the user picked a device
            # that context would land on GPU 0 for every rank. The doctor asks in its own process.
            out["cuda"] = "unknown: CUDA not initialised yet (run `python -m gdn_compat` on the GPU node)"
            return
        major, minor = torch.cuda.get_device_capability()
        out["cuda_capability"] = (major, minor)
        out["cuda"] = f"sm_{major}{minor} {torch.cuda.get_device_name()}"
    except Exception as exc:  # noqa: BLE001
        out["cuda"] = f"unknown: {_why(exc)}"


def probe(*, init_cuda: bool = False) -> Facts:
    """Inspect the installed stack. Imports megatron-core and fla modules; changes nothing."""
    out: dict[str, Any] = {"python": platform.python_version()}
    torch: Any = None
    try:
        import torch

        out["torch"] = torch.__version__
        _probe_cuda(out, torch, init_cuda)
    except Exception as exc:  # noqa: BLE001
        out["cuda"] = f"unknown: torch failed to import ({_why(exc)})"
        torch = None
    triton = _dist_version("triton", "pytorch-triton")
    out["triton"] = triton[1] if triton else None
    tilelang = _dist_version("tilelang")
    out["tilelang"] = tilelang[1] if tilelang else None
    mc = _dist_version("megatron-core", "megatron_core")
    out["megatron"] = mc[1] if mc else None
    if torch is not None:
        try:
            import megatron.core as mcore

            out["megatron_path"] = str(mcore.__file__).rsplit("/", 1)[0]
            if out["megatron"] is None:
                out["megatron"] = getattr(mcore, "__version__", None)
        except ModuleNotFoundError:
            pass
        except Exception as exc:  # noqa: BLE001
            out["megatron_error"] = _why(exc)
        if out.get("megatron_path"):
            _probe_fla(out)
            _probe_gdn(out)
            _probe_mtp(out)
        elif out["megatron"] is not None:
            why = out.get("megatron_error") or "not importable"
            out["gdn"] = out["gdn_thd"] = out["gdn_cp"] = out["mtp"] = f"unknown: megatron.core {why}"
        else:
            _probe_fla(out)
    return Facts(**out)
