"""GatedDeltaNet: where it lives, how its forward takes packed sequences and context parallelism, its gate method,
its deterministic THD refusal (0.18/0.19)."""

from __future__ import annotations

import inspect
import re
import sys
from typing import Any

from gdn_compat._probe.facts import GDN_MODULE, Accepts, Conv, Cp, Layout, Thd, _import, _why, accepts, source

# The 0.16/0.17 GatedDeltaNet.forward parameters; the gdn_thd replacement has exactly these.
GDN_LEGACY_PARAMS = (
    "self", "hidden_states", "attention_mask", "key_value_states", "inference_context",
    "attention_bias", "packed_seq_params", "sequence_len_offset", "inference_params", "kwargs",
)
# The 0.18/0.19 GatedDeltaNet.forward parameters (native THD); gdn_thd_deterministic wraps exactly these.
GDN_NATIVE_PARAMS = (
    "self", "hidden_states", "attention_mask", "inference_context", "packed_seq_params", "sequence_len_offset",
    "inference_params", "kwargs",
)
DETERMINISTIC_THD_REFUSAL = "Packed sequence does not support deterministic mode"


_REFUSES_THD = re.compile(
    r"if\s+packed_seq_params\s+is\s+not\s+None\s*:\s*(?:#[^\n]*\s*)*raise\s+NotImplementedError"
)


def _probe_gdn(out: dict[str, Any]) -> None:
    mod = _import(GDN_MODULE, out, "gdn")
    cls = getattr(mod, "GatedDeltaNet", None)
    if mod is None or cls is None:
        if mod is not None:
            out["gdn"], out["notes"]["gdn"] = Layout.UNKNOWN, f"{GDN_MODULE} has no GatedDeltaNet"
        if out.get("gdn") == "unknown":
            out["gdn_thd"] = out["gdn_cp"] = "unknown"
        return
    defining = sys.modules.get(cls.__module__)
    out["gdn"] = Layout.PACKAGE if str(getattr(mod, "__file__", "")).endswith("__init__.py") else Layout.MODULE
    out["gdn_file"] = getattr(defining, "__file__", None)
    out["gdn_init_cp_comm_type"] = accepts(cls.__init__, "cp_comm_type")
    out["gdn_backward_dw"] = Accepts.YES if callable(getattr(cls, "backward_dw", None)) else Accepts.NO
    if out["gdn_backward_dw"] is Accepts.YES:  # where it comes from: the release's class, or something else
        home = next((c for c in cls.__mro__ if "backward_dw" in c.__dict__), cls)
        func = getattr(home.__dict__["backward_dw"], "__wrapped__", home.__dict__["backward_dw"])
        code = getattr(func, "__code__", None)
        home_file = getattr(sys.modules.get(home.__module__), "__file__", None)
        own = home.__module__.startswith(GDN_MODULE) and code is not None and code.co_filename == home_file
        out["notes"]["gdn_backward_dw"] = (
            f"the release's own, defined by {home.__qualname__} in {home.__module__}" if own else
            f"not the release's: defined by {home.__module__}.{home.__qualname__} "
            f"({getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', '?')})")
    try:
        params = tuple(inspect.signature(cls.forward).parameters)
        src, cls_src = source(cls.forward), source(cls)
    except (TypeError, OSError, ValueError) as exc:
        out["gdn_thd"] = out["gdn_cp"] = "unknown"
        out["notes"]["gdn_thd"] = f"cannot read GatedDeltaNet.forward: {_why(exc)}"
        return
    if "packed_seq_params" not in params:
        out["gdn_thd"], out["notes"]["gdn_thd"] = Thd.UNKNOWN, "GatedDeltaNet.forward takes no packed_seq_params"
    elif _REFUSES_THD.search(src):
        out["gdn_thd"] = Thd.REFUSES
    elif "qkv_format" in src and "cu_seqlens" in src:
        out["gdn_thd"] = Thd.NATIVE
    else:
        out["gdn_thd"] = Thd.UNKNOWN
        out["notes"]["gdn_thd"] = "GatedDeltaNet.forward neither refuses nor handles qkv_format='thd'"
    out["gdn_cp"] = Cp.NATIVE if re.search(r"pg_collection\.cp\b|cp_size", cls_src) else Cp.NONE
    out["gdn_legacy_shape"] = bool(
        params == GDN_LEGACY_PARAMS
        and out["gdn_thd"] is Thd.REFUSES
        and callable(getattr(cls, "_apply_gated_norm", None))
        and callable(getattr(defining, "torch_chunk_gated_delta_rule", None))
        and "l2norm" in vars(defining or object)
    )
    _probe_deterministic_thd(out, cls, defining, params, src)
    if out["gdn_legacy_shape"]:
        has_pkg = getattr(defining, "causal_conv1d_fn", None) is not None
        out["gdn_conv"] = Conv.CAUSAL_CONV1D if has_pkg else Conv.NN_CONV1D
    else:
        out["gdn_conv"] = Conv.FLA if out["gdn_thd"] is Thd.NATIVE else Conv.UNKNOWN


def _probe_deterministic_thd(out: dict[str, Any], cls: Any, defining: Any, params: tuple, src: str) -> None:
    """0.18/0.19: native THD, but ``assert not deterministic_mode`` for packed input (upstream #5718)."""
    if out["gdn_thd"] is Thd.REFUSES:
        return  # no native THD: gdn_thd gives deterministic packing along with THD
    if out["gdn_thd"] is not Thd.NATIVE:
        out["gdn_thd_deterministic"] = Accepts.UNKNOWN
        return
    out["gdn_native_shape"] = bool(params == GDN_NATIVE_PARAMS and callable(getattr(cls, "_apply_gated_norm", None))
                                   and callable(getattr(defining, "torch_chunk_gated_delta_rule", None)))
    out["gdn_gate_exp"], out["gdn_gate_method"], out["gdn_gate_compiled"] = _gate(cls)
    # 0.18: unpacks the pack with the module's _unpack_sequence and runs an all-to-all per sequence
    out["gdn_cp_per_sequence"] = bool(callable(getattr(defining, "_unpack_sequence", None))
                                      and re.search(r"_unpack_sequence\([^)]*cp_size", src) is not None)
    if DETERMINISTIC_THD_REFUSAL not in src:
        out["gdn_thd_deterministic"] = Accepts.UNKNOWN
        out["notes"]["gdn_thd_deterministic"] = "GatedDeltaNet.forward no longer carries the deterministic THD assertion"
    elif not out["gdn_native_shape"]:
        out["gdn_thd_deterministic"] = Accepts.UNKNOWN
        out["notes"]["gdn_thd_deterministic"] = ("GatedDeltaNet refuses deterministic THD, but its forward "
                                                 "signature or helpers differ from 0.18/0.19")
    else:
        out["gdn_thd_deterministic"] = Accepts.NO


GATE_PARAMS = ("self", "A_log_local_cp", "dt_bias_local_cp", "alpha", "beta")


def _compiled(method: Any) -> Accepts:
    """Whether ``method`` runs through torch.compile as things stand: megatron's ``jit_fuser`` wrapped it, dynamo
    is not disabled, and inductor does not emulate eager's intermediate roundings. Then a bf16 ``A_log.exp()``
    inside it is computed in fp32 (inductor upcasts loads and rounds only at stores)."""
    if getattr(method, "_torchdynamo_orig_callable", None) is None:
        return Accepts.NO
    try:
        import torch._dynamo
        import torch._inductor.config as inductor
    except Exception:  # noqa: BLE001
        return Accepts.UNKNOWN
    if torch._dynamo.config.disable or getattr(inductor, "emulate_precision_casts", False):
        return Accepts.NO
    return Accepts.YES


def _gate(cls: Any) -> tuple[str, str, Accepts]:
    """(the exp of A_log as written, the gate method, whether it runs compiled) of the GDN class's gate method:
    0.18/0.19 ``_compute_g_and_beta``, main's ``_compute_gates`` (returns ``(g, {'beta': ...})``); 0.16/0.17
    compute the gate inline in ``forward``."""
    name = next((n for n in ("_compute_g_and_beta", "_compute_gates") if getattr(cls, n, None) is not None), "")
    if not name:
        return "absent", "", Accepts.ABSENT
    method = getattr(cls, name)
    func = getattr(method, "_torchdynamo_orig_callable", None) or getattr(method, "__wrapped__", method)
    try:
        params, src = tuple(inspect.signature(func).parameters), source(func)
    except (TypeError, OSError, ValueError):
        return "unknown", name, _compiled(method)
    if name == "_compute_g_and_beta" and params != GATE_PARAMS:
        return "unknown", name, _compiled(method)
    if re.search(r"-\s*A_log_local_cp\.exp\(\)", src):
        return "parameter dtype", name, _compiled(method)
    if re.search(r"A_log_local_cp\.float\(\)\.exp\(\)", src):
        return "fp32", name, _compiled(method)
    return "unknown", name, _compiled(method)
