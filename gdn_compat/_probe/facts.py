"""The probe record: what ``probe()`` found, as typed values (``Facts``), and the helpers every subject's probe
uses. Where megatron keeps what gdn_compat patches (module names) is said here once."""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import importlib.metadata as md
import inspect
from typing import Any

GDN_MODULE = "megatron.core.ssm.gated_delta_net"
MTP_MODULE = "megatron.core.transformer.multi_token_prediction"
CONFIG_MODULE = "megatron.core.transformer.transformer_config"
FINALIZE_MODULE = "megatron.core.distributed.finalize_model_grads"


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
    state_steps: Accepts = Accepts.ABSENT  # fla-core 0.4.2's chunk steps, as gdn_cp_state's fla path calls them

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
    config_gdn_heads_divide_cp: bool = False  # it asserts GDN's key and value heads divide tp x cp (0.18/0.19)
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


@functools.lru_cache(maxsize=256)
def source(obj: Any) -> str:
    """``inspect.getsource(obj)``, read once per object: ``apply()``, ``plan()``, ``report()`` and the doctor probe
    the same release functions, classes and fla modules every time. A method replaced on its class, or a module
    imported again, is another object and is read anew; an unreadable one raises every time."""
    return inspect.getsource(obj)


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
