"""Read-only facts about the installed stack, found by inspection, never by version strings.

``probe()`` never raises and changes nothing. Every question it cannot answer gets the value
``UNKNOWN`` and a line in ``Facts.notes`` saying why. Patch decisions read these shapes; versions are
kept for messages, and only the kernel-stack hazards (``hazards.py``) compare them.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.metadata as md
import inspect
import os
import platform
import re
import sys
from typing import Any

GDN_MODULE = "megatron.core.ssm.gated_delta_net"
MTP_MODULE = "megatron.core.transformer.multi_token_prediction"
CONFIG_MODULE = "megatron.core.transformer.transformer_config"
FINALIZE_MODULE = "megatron.core.distributed.finalize_model_grads"

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


class _Value(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)


class Layout(_Value):
    ABSENT = "absent"
    MODULE = "module"  # megatron/core/ssm/gated_delta_net.py (0.16-0.18)
    PACKAGE = "package"  # megatron/core/ssm/gated_delta_net/ (0.19)
    UNKNOWN = "unknown"


class Thd(_Value):
    ABSENT = "absent"
    REFUSES = "refuses"
    NATIVE = "native"
    UNKNOWN = "unknown"


class Cp(_Value):
    ABSENT = "absent"
    NONE = "none"
    NATIVE = "native"
    UNKNOWN = "unknown"


class Conv(_Value):
    ABSENT = "absent"
    CAUSAL_CONV1D = "causal_conv1d package"
    NN_CONV1D = "nn.Conv1d"
    FLA = "fla causal_conv1d"
    UNKNOWN = "unknown"


class Mtp(_Value):
    ABSENT = "absent"
    GENERIC = "generic"  # (self, forward_func, *args, **kwargs): 0.15-0.17
    NO_PADDING_MASK = "no_padding_mask"  # 0.18: forward passes padding_mask, the method lacks it
    HAS_PADDING_MASK = "has_padding_mask"  # 0.19
    UNKNOWN = "unknown"


class Roll(_Value):
    """How ``multi_token_prediction._roll_tensor_packed_seq`` finds sequence boundaries."""

    ABSENT = "absent"
    UNPADDED = "by cu_seqlens_q"  # 0.16-0.19.2: ignores cu_seqlens_q_padded (the hole)
    PADDED = "by cu_seqlens_q_padded"
    UNKNOWN = "unknown"


class Accepts(_Value):
    YES = "yes"
    NO = "no"
    ABSENT = "absent"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class Dist:
    """An installed distribution: name, version, where its package lives."""

    name: str
    version: str
    path: str | None = None

    def __str__(self) -> str:
        return f"{self.name} {self.version}"


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]

    def __str__(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]} {self.name}"


@dataclasses.dataclass(frozen=True)
class Varlen:
    """Which fla entry points take the varlen (packed) arguments gdn_thd hands them."""

    rule: Accepts = Accepts.ABSENT  # chunk_gated_delta_rule(cu_seqlens=)
    rule_cpu: Accepts = Accepts.ABSENT  # chunk_gated_delta_rule(cu_seqlens_cpu=)
    conv: Accepts = Accepts.ABSENT  # causal_conv1d(cu_seqlens=)
    conv_cpu: Accepts = Accepts.ABSENT  # causal_conv1d(cu_seqlens_cpu=)
    rule_chunks: Accepts = Accepts.ABSENT  # chunk_gated_delta_rule(chunk_indices=) (fla-core >= 0.6)
    rule_inner: Accepts = Accepts.ABSENT  # fla's chunk_gated_delta_rule_fwd/_bwd take chunk_indices (0.4.x)
    conv_chunks: Accepts = Accepts.ABSENT  # causal_conv1d(chunk_indices=)

    @property
    def usable(self) -> bool:
        return self.rule is Accepts.YES and self.conv is Accepts.YES

    @property
    def graph_safe(self) -> bool:
        """Both kernels can be handed chunk indices computed on the device (no host read per call)."""
        rule = Accepts.YES in (self.rule_chunks, self.rule_inner)
        return self.usable and rule and self.conv_chunks is Accepts.YES


@dataclasses.dataclass(frozen=True)
class Facts:
    """What ``probe()`` found. ``notes[field]`` says why a field is ``UNKNOWN`` (or how it was read)."""

    python: str
    torch: str | None = None
    triton: str | None = None
    tilelang: str | None = None  # fla >= 0.5 can use it instead of the miscompiled Triton kernel
    rocm: str | None = None  # torch's HIP version on a ROCm build
    gpu: Gpu | None = None  # None: no GPU, or not inspected (see notes["gpu"])
    megatron: Dist | None = None
    fla: Dist | None = None
    fla_error: str | None = None  # fla is installed but fails to import
    fla_varlen: Varlen = Varlen()
    fla_atomic_free: Accepts = Accepts.ABSENT  # YES: the fla code packed GDN runs has no atomics / scatter-adds
    fla_zero_length: Accepts = Accepts.ABSENT  # YES: fla's own chunk indices are right for offsets with empty entries
    fla_blackwell_wy_guard: Accepts = Accepts.ABSENT  # prepare_wy_repr_bwd autotune restricted on Blackwell (fla PR #1000)
    fla_flashqla_backend: Accepts = Accepts.ABSENT  # fla routes its delta rule to FlashQLA by itself (fla #998, >= 0.5.2)
    fla_flashqla_off: bool = False  # FLA_FLASH_QLA=0 turns that routing off
    flashqla: Dist | None = None  # flash-qla, read from its metadata (importing it needs CUDA and tilelang)
    flashqla_atomic_free: Accepts = Accepts.ABSENT  # FlashQLA's source has no atomics (read from its files)
    flashqla_metadata: Accepts = Accepts.ABSENT  # FlashQLA takes a pack's chunk metadata attached to its offsets
    gdn: Layout = Layout.ABSENT
    gdn_file: str | None = None
    gdn_thd: Thd = Thd.ABSENT
    gdn_legacy_shape: bool = False  # the exact 0.16/0.17 forward and helpers gdn_thd relies on
    gdn_native_shape: bool = False  # the exact 0.18/0.19 native-THD forward and helpers gdn_compat's routes wrap
    gdn_cp_per_sequence: bool = False  # native packed CP runs one all-to-all per sequence (0.18; 0.19 fused, #4913)
    gdn_gate_exp: str = "absent"  # the gate method's exp of A_log as written: "parameter dtype", "fp32", "unknown"
    gdn_gate_method: str = ""  # that method: "_compute_g_and_beta" (0.18/0.19), "_compute_gates" (main), "" (inline)
    gdn_gate_compiled: Accepts = Accepts.ABSENT  # YES: it runs through torch.compile now (megatron's jit_fuser)
    gdn_cp: Cp = Cp.ABSENT
    gdn_conv: Conv = Conv.ABSENT  # the unpacked conv of this release's GDN
    gdn_init_cp_comm_type: Accepts = Accepts.ABSENT  # GatedDeltaNet.__init__(cp_comm_type=)
    gdn_backward_dw: Accepts = Accepts.ABSENT  # GatedDeltaNet.backward_dw (MoE EP overlap calls it; 0.17.0+)
    gdn_thd_deterministic: Accepts = Accepts.ABSENT  # native THD forward runs in deterministic_mode (NO: asserts)
    config_refuses_gdn_cp: bool = False  # TransformerConfig asserts cp == 1 for gated_delta_net
    gdn_out_norm_tp_sum: Accepts = Accepts.ABSENT  # finalize_model_grads sums GDN out_norm grads over tp
    mtp: Mtp = Mtp.ABSENT
    mtp_roll: Roll = Roll.ABSENT  # the MTP roll of a packed micro-batch
    notes: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def release(self) -> str:
        """``megatron-core X`` for messages."""
        return f"megatron-core {self.megatron.version}" if self.megatron else "megatron-core (not installed)"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _dist(*names: str) -> Dist | None:
    for name in names:
        try:
            return Dist(name, md.version(name))
        except md.PackageNotFoundError:
            continue
    return None


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def accepts(func: Any, name: str) -> Accepts:
    """Whether ``func``'s signature has a parameter ``name`` (UNKNOWN when it cannot be read)."""
    if func is None:
        return Accepts.ABSENT
    try:
        return Accepts.YES if name in inspect.signature(func).parameters else Accepts.NO
    except (TypeError, ValueError):
        return Accepts.UNKNOWN


def _import(name: str, out: dict[str, Any], field: str) -> Any:
    """The module, or None when it does not exist (field stays ABSENT) or fails (UNKNOWN + note)."""
    problem: Exception
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            return None
        problem = exc
    except Exception as exc:  # noqa: BLE001 - a broken import is a finding, not a crash
        problem = exc
    out[field] = "unknown"
    out["notes"][field] = f"importing {name} failed: {_why(problem)}"
    return None


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
        src, cls_src = inspect.getsource(cls.forward), inspect.getsource(cls)
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
        params, src = tuple(inspect.signature(func).parameters), inspect.getsource(func)
    except (TypeError, OSError, ValueError):
        return "unknown", name, _compiled(method)
    if name == "_compute_g_and_beta" and params != GATE_PARAMS:
        return "unknown", name, _compiled(method)
    if re.search(r"-\s*A_log_local_cp\.exp\(\)", src):
        return "parameter dtype", name, _compiled(method)
    if re.search(r"A_log_local_cp\.float\(\)\.exp\(\)", src):
        return "fp32", name, _compiled(method)
    return "unknown", name, _compiled(method)


def _probe_config(out: dict[str, Any]) -> None:
    from gdn_compat.patches.config_gdn_cp import refuses_gdn_cp  # the probe that patch relies on

    try:
        config = importlib.import_module(CONFIG_MODULE).TransformerConfig
    except Exception as exc:  # noqa: BLE001
        out["notes"]["config_refuses_gdn_cp"] = f"not read: importing {CONFIG_MODULE} failed: {_why(exc)}"
        return
    out["config_refuses_gdn_cp"] = refuses_gdn_cp(config)


_SELECTS_SP = re.compile(r"config\.sequence_parallel\s+and\s+getattr\(\s*param,\s*[\"']sequence_parallel")


def _probe_finalize(out: dict[str, Any]) -> None:
    """Does the release's TP reduction of replicated grads already cover GDN's out_norm?"""
    try:
        mod = importlib.import_module(FINALIZE_MODULE)
        src = inspect.getsource(mod.__dict__["_allreduce_non_tensor_model_parallel_grads"])
    except Exception as exc:  # noqa: BLE001
        out["gdn_out_norm_tp_sum"] = Accepts.UNKNOWN
        out["notes"]["gdn_out_norm_tp_sum"] = f"cannot read {FINALIZE_MODULE}: {_why(exc)}"
        return
    if "out_norm" in src or "GatedDeltaNet" in src or "gated_delta" in src:
        out["gdn_out_norm_tp_sum"] = Accepts.YES
    elif _SELECTS_SP.search(src):
        out["gdn_out_norm_tp_sum"] = Accepts.NO
    else:
        out["gdn_out_norm_tp_sum"] = Accepts.UNKNOWN
        out["notes"]["gdn_out_norm_tp_sum"] = "_allreduce_non_tensor_model_parallel_grads selects grads in an unknown way"


_PASSES_MASK = re.compile(r"self\._checkpointed_forward\((?:[^()]|\([^()]*\))*padding_mask\s*=", re.S)


def _mtp_shape(cls: Any) -> tuple[Mtp, str]:
    ckpt = dict(inspect.signature(cls._checkpointed_forward).parameters)
    fwd_src = inspect.getsource(cls.forward)
    layer = cls.__dict__.get("_proj_and_transformer_layer")
    layer_params = inspect.signature(layer).parameters if layer else {}
    if "forward_func" in ckpt:
        return Mtp.GENERIC, ""
    if "padding_mask" in ckpt:
        return Mtp.HAS_PADDING_MASK, ""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ckpt.values()):
        return Mtp.UNKNOWN, "_checkpointed_forward takes **kwargs"
    if not _PASSES_MASK.search(fwd_src):
        return Mtp.UNKNOWN, "forward does not pass padding_mask to _checkpointed_forward"
    if "padding_mask" not in layer_params:
        return Mtp.UNKNOWN, "_proj_and_transformer_layer takes no padding_mask"
    return Mtp.NO_PADDING_MASK, ""


ROLL_PARAMS = ("tensor", "shifts", "dims", "packed_seq_params", "cp_group")  # 0.16-0.19; main adds return_sum


def _roll_shape(mod: Any) -> tuple[Roll, str]:
    """Run the release's packed roll once on a tiny CPU pack laid out by padded slots: sequences of
    2 and 3 tokens in slots of 4, values 1..8. Rolling by the padded slots gives [2,0,0,0, 6,7,0,0];
    by the unpadded offsets [0,2,5] (the hole) it gives [2,0, 4,5,0, 6,7,8]."""
    import types

    import torch

    func, roll = mod.__dict__.get("_roll_tensor_packed_seq"), mod.__dict__.get("roll_tensor")
    if func is None or roll is None:
        return Roll.ABSENT, ""
    params = tuple(inspect.signature(func).parameters)
    if params not in (ROLL_PARAMS, (*ROLL_PARAMS, "return_sum")):
        return Roll.UNKNOWN, f"_roll_tensor_packed_seq{inspect.signature(func)} is not {ROLL_PARAMS} (+ return_sum)"
    if not re.search(r"\breturn\s+_roll_tensor_packed_seq\(", inspect.getsource(roll)):
        return Roll.UNKNOWN, "roll_tensor does not hand packed input to _roll_tensor_packed_seq"
    unpadded, padded = torch.tensor([0, 2, 5]), torch.tensor([0, 4, 8])
    psp = types.SimpleNamespace(qkv_format="thd", cu_seqlens_q=unpadded, cu_seqlens_kv=unpadded,
                                cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    try:
        got = func(torch.arange(1, 9)[None], -1, -1, psp, None)[0][0].tolist()
    except Exception as exc:  # noqa: BLE001 - an unknown shape, not a crash
        return Roll.UNKNOWN, f"_roll_tensor_packed_seq failed on a padded pack: {_why(exc)}"
    if got == [2, 0, 0, 0, 6, 7, 0, 0]:
        return Roll.PADDED, ""
    if got == [2, 0, 4, 5, 0, 6, 7, 8]:
        return Roll.UNPADDED, ""
    return Roll.UNKNOWN, f"_roll_tensor_packed_seq rolls a padded pack in an unknown way: {got}"


def _probe_mtp(out: dict[str, Any]) -> None:
    mod = _import(MTP_MODULE, out, "mtp")
    if mod is None:
        if out.get("mtp") == "unknown":
            out["mtp_roll"] = Roll.UNKNOWN
        return
    try:
        out["mtp_roll"], note = _roll_shape(mod)
    except (TypeError, OSError, ValueError) as exc:
        out["mtp_roll"], note = Roll.UNKNOWN, f"cannot read _roll_tensor_packed_seq: {_why(exc)}"
    if note:
        out["notes"]["mtp_roll"] = note
    cls = getattr(mod, "MultiTokenPredictionLayer", None)
    try:
        if cls is None or not hasattr(cls, "_checkpointed_forward"):
            raise LookupError("MultiTokenPredictionLayer._checkpointed_forward not found")
        out["mtp"], note = _mtp_shape(cls)
    except (LookupError, TypeError, OSError, ValueError) as exc:
        out["mtp"], note = Mtp.UNKNOWN, f"cannot read MultiTokenPredictionLayer: {_why(exc)}"
    if note:
        out["notes"]["mtp"] = note


def _probe_fla(out: dict[str, Any]) -> None:
    out["fla"] = _dist("fla-core", "flash-linear-attention")
    try:
        rule = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
        conv = importlib.import_module("fla.modules.convolution").causal_conv1d
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "fla":
            return
        out["fla_error"] = _why(exc)
    except Exception as exc:  # noqa: BLE001 - e.g. fla 0.4.x with Triton >= 3.7 raises ValueError
        out["fla_error"] = _why(exc)
    else:
        if out["fla"] is not None:
            out["fla"] = dataclasses.replace(out["fla"], path=getattr(sys.modules.get("fla"), "__file__", None))
        out["fla_varlen"] = Varlen(rule=accepts(rule, "cu_seqlens"), rule_cpu=accepts(rule, "cu_seqlens_cpu"),
                                   conv=accepts(conv, "cu_seqlens"), conv_cpu=accepts(conv, "cu_seqlens_cpu"),
                                   rule_chunks=accepts(rule, "chunk_indices"), rule_inner=_inner_rule(),
                                   conv_chunks=accepts(conv, "chunk_indices"))
        out["fla_atomic_free"], out["notes"]["fla_atomic_free"] = atomic_free(rule, conv)
        out["fla_zero_length"], out["notes"]["fla_zero_length"] = zero_length()
        out["fla_blackwell_wy_guard"] = _blackwell_wy_guard()
        out["fla_flashqla_backend"] = _fla_flashqla_backend()
        out["fla_flashqla_off"] = os.environ.get("FLA_FLASH_QLA", "").strip() == "0"
        return
    unknown = Accepts.UNKNOWN
    out["fla_varlen"] = Varlen(unknown, unknown, unknown, unknown)
    out["notes"]["fla_varlen"] = f"fla failed to import ({out['fla_error']})"


# Offsets with zero-length entries, [0, 3, 3, 70, 70]: three sequences, the middle and last empty. Their 64-token
# chunks as (sequence, chunk): one of sequence 0, two of sequence 2.
ZERO_LENGTH_PACK, ZERO_LENGTH_CHUNKS = [0, 3, 3, 70, 70], [[0, 0], [2, 0], [2, 1]]


def zero_length(prepare: Any = None) -> tuple[Accepts, str]:
    """Whether fla's ``prepare_chunk_indices`` (what its varlen delta rule and Triton conv call when given only
    ``cu_seqlens``, as megatron 0.18/0.19 call them) numbers the chunks of offsets with zero-length entries right.
    It is plain torch, so it runs here on the CPU: fla-core 0.4.x and 0.5.0 number a chunk's sequence by counting
    the chunks that start one (``indices.eq(0).cumsum(0) - 1``), which skips empty sequences and hands every later
    chunk the offsets of the sequence before it: garbage or NaN, measured on an H200."""
    if prepare is None:
        try:
            prepare = importlib.import_module("fla.ops.utils.index").prepare_chunk_indices
        except Exception as exc:  # noqa: BLE001 - not found: unknown
            return Accepts.UNKNOWN, f"fla.ops.utils.index.prepare_chunk_indices not readable: {_why(exc)}"
    try:
        import torch

        got = prepare(torch.tensor(ZERO_LENGTH_PACK, dtype=torch.int64), 64).tolist()
    except Exception as exc:  # noqa: BLE001 - it failed on the CPU: unknown, not a crash
        return Accepts.UNKNOWN, f"prepare_chunk_indices failed on offsets {ZERO_LENGTH_PACK}: {_why(exc)}"
    if got == ZERO_LENGTH_CHUNKS:
        return Accepts.YES, f"prepare_chunk_indices({ZERO_LENGTH_PACK}, 64) = {got}, right"
    return Accepts.NO, (f"prepare_chunk_indices({ZERO_LENGTH_PACK}, 64) = {got}, expected {ZERO_LENGTH_CHUNKS}: "
                        f"chunks after a zero-length entry get another sequence's offsets")


# fla PR #1000 (for fla issue #999): on Blackwell, prepare_wy_repr_bwd's autotune space is cut to one config,
# because wider ones hang the backward at long sequences.
_WY_GUARD = re.compile(r"PREPARE_WY_REPR_BWD_NUM_\w+\s*=.*IS_NVIDIA_BLACKWELL")


def _blackwell_wy_guard() -> Accepts:
    try:
        source = inspect.getsource(importlib.import_module("fla.ops.gated_delta_rule.wy_fast"))
    except Exception:  # noqa: BLE001 - unreadable: unknown
        return Accepts.UNKNOWN
    return Accepts.YES if _WY_GUARD.search(source) else Accepts.NO


# What gdn_thd's _Rule passes to fla 0.4.x's own forward and backward, by keyword.
INNER_FWD = {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens", "chunk_indices"}
INNER_BWD = {"q", "k", "v", "g", "beta", "A", "scale", "initial_state", "do", "dht", "cu_seqlens", "chunk_indices"}


def _inner_rule() -> Accepts:
    """fla's ``chunk_gated_delta_rule_fwd`` / ``_bwd`` take every argument gdn_thd's ``_Rule`` passes."""
    try:
        mod = importlib.import_module("fla.ops.gated_delta_rule.chunk")
        fwd, bwd = mod.chunk_gated_delta_rule_fwd, mod.chunk_gated_delta_rule_bwd
        ok = INNER_FWD <= set(inspect.signature(fwd).parameters) and INNER_BWD <= set(inspect.signature(bwd).parameters)
    except AttributeError:
        return Accepts.ABSENT
    except Exception:  # noqa: BLE001 - unreadable: not used
        return Accepts.UNKNOWN
    return Accepts.YES if ok else Accepts.NO


# Order-dependent accumulation: Triton atomics, and torch's accumulating index ops (atomics on CUDA).
_ATOMIC = re.compile(r"\b(?:tl\.atomic_\w+|atomic_add|atomic_max|atomic_min|atomic_xchg|atomic_cas|index_add_?|"
                     r"scatter_add_?|scatter_reduce_?|index_reduce_?|index_put_?)\b")


def _fla_module_of(obj: Any, prefix: str, depth: int = 0) -> str | None:
    """The fla module that defines ``obj`` (a Triton Autotuner/Heuristics is unwrapped to its ``fn``)."""
    name = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
    if isinstance(name, str) and (name == prefix or name.startswith(prefix + ".")):
        return name
    if not inspect.ismodule(obj) and depth < 4 and hasattr(obj, "fn"):
        return _fla_module_of(obj.fn, prefix, depth + 1)
    return None


def atomic_free(*entry_points: Any, prefix: str = "fla") -> tuple[Accepts, str]:
    """Whether the code that ``entry_points`` reach (their modules, and every ``prefix`` module those
    name, transitively) is free of atomics and accumulating scatters: with none, a Triton kernel at a
    fixed launch configuration sums in a fixed order, so its results repeat bit for bit."""
    roots = [_fla_module_of(f, prefix) for f in entry_points]
    todo, seen, hits = [r for r in roots if r], set(), []
    if not todo:
        return Accepts.UNKNOWN, "entry points not found in fla"
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        module = sys.modules.get(name)
        if module is None:
            continue
        try:
            found = sorted(set(_ATOMIC.findall(inspect.getsource(module))))
        except (OSError, TypeError):  # a package without source: nothing proves it atomic-free
            return Accepts.UNKNOWN, f"source of {name} not readable"
        if found:
            hits.append(f"{name} ({', '.join(found)})")
        todo += [m for m in (_fla_module_of(v, prefix) for v in list(vars(module).values())) if m and m not in seen]
    if hits:
        return Accepts.NO, f"{len(seen)} modules read; atomics or scatter-adds in " + "; ".join(hits)
    return Accepts.YES, f"{len(seen)} modules read, none has atomics or scatter-adds"


def _probe_flashqla(out: dict[str, Any]) -> None:
    """FlashQLA without importing it (its import initialises CUDA and asks tilelang for the GPU): the version,
    and whether its source files hold atomics (each kernel then sums in a fixed order)."""
    out["flashqla"] = found = _dist("flash-qla", "flash_qla")
    if found is None:
        return
    try:
        files = [f for f in md.distribution(found.name).files or () if str(f).endswith(".py")]
        hits = sorted({h for f in files for h in _ATOMIC.findall(f.read_text() or "")})
    except Exception as exc:  # noqa: BLE001 - unreadable: nothing proves it atomic-free
        out["flashqla_atomic_free"] = Accepts.UNKNOWN
        out["notes"]["flashqla_atomic_free"] = f"FlashQLA's files not readable: {_why(exc)}"
        return
    out["flashqla_atomic_free"] = Accepts.NO if hits or not files else Accepts.YES
    out["notes"]["flashqla_atomic_free"] = (f"{len(files)} files read; " + (f"atomics: {', '.join(hits)}" if hits
                                            else "none has atomics or scatter-adds"))
    index = next((f for f in files if str(f).replace("\\", "/").endswith("flash_qla/utils/index.py")), None)
    text = (index.read_text() or "") if index is not None else ""
    out["flashqla_metadata"], out["notes"]["flashqla_metadata"] = _flashqla_metadata(text)


FLASHQLA_METADATA = "_flash_qla_prepared_varlen"


def _flashqla_metadata(source: str) -> tuple[Accepts, str]:
    """Whether FlashQLA's index helpers (``flash_qla/utils/index.py``) take a pack's chunk metadata from an attribute
    of its offsets tensor, as (chunk size, chunk offsets, chunk count, chunk indices), before any cache or host read
    (flash-qla 0.1.3's ``prepare_varlen_metadata`` attaches it so; ``prepare_chunk_indices`` returns ``prepared[3]``,
    ``prepare_chunk_offsets`` ``prepared[1:3]``). Then gdn_compat can attach metadata built by device ops, of fixed
    size, and a CUDA graph of a FlashQLA step replays any layout."""
    if not source:
        return Accepts.UNKNOWN, "flash_qla/utils/index.py not found among its files"
    wanted = (f'getattr(cu_seqlens, "{FLASHQLA_METADATA}", None)', "return prepared[3]", "return prepared[1:3]",
              "prepared[0] == chunk_size")
    missing = [w for w in wanted if w not in source]
    if missing:
        return Accepts.NO, f"flash_qla/utils/index.py lacks {missing}: chunk metadata is read on the host"
    return Accepts.YES, f"flash_qla/utils/index.py reads {FLASHQLA_METADATA} (size, offsets, count, indices)"


def _fla_flashqla_backend() -> Accepts:
    """fla >= 0.5.2 dispatches chunk_gated_delta_rule to FlashQLA whenever flash_qla imports (fla #998)."""
    import importlib.util

    try:
        return Accepts.YES if importlib.util.find_spec("fla.ops.gated_delta_rule.backends.flash_qla") else Accepts.NO
    except Exception:  # noqa: BLE001 - no such package: no such backend
        return Accepts.NO


def _probe_gpu(out: dict[str, Any], torch: Any, init_cuda: bool) -> None:
    try:
        if not torch.cuda.is_available():
            out["notes"]["gpu"] = "no CUDA device"
        elif not (init_cuda or torch.cuda.is_initialized()):
            # Asking for the capability creates a CUDA context; before the user picked a device
            # that context would land on GPU 0 for every rank. The doctor asks in its own process.
            out["notes"]["gpu"] = "not inspected: CUDA not initialised yet (run `python -m gdn_compat` on the GPU node)"
        else:
            out["gpu"] = Gpu(torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability()))
    except Exception as exc:  # noqa: BLE001
        out["notes"]["gpu"] = f"not inspected: {_why(exc)}"


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
