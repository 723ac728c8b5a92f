"""The packed core's two opt-in fast paths, and the one place that decides, per call, whether a call takes them.

* ``flashqla`` (patch ``gdn_flashqla``): the delta rule through FlashQLA's TileLang kernels (flash-qla >= 0.1.3)
  with q/k not repeated (FlashQLA takes grouped value heads); everything else stays the release's kernels.
* ``fused`` (patch ``gdn_fused``): gdn_compat's own Triton kernels for the region between the input
  projection and the delta rule and between the delta rule and the output projection (``gdn_compat.fused``),
  around whichever delta-rule core applies (FlashQLA's when ``flashqla`` is on too, else fla's).

A call that cannot take a path keeps the default one, and the reason is logged once per process (a WARNING on the
``gdn_compat`` logger; INFO for an empty pack). One case is an error instead, because no fallback could be silent
there: FlashQLA under CUDA-graph capture or with a ``PackBuffer`` when the installed FlashQLA does not take a pack's
chunk metadata from its offsets tensor (then it would read a chunk count on the host). Where it does (flash-qla
0.1.3), a graph-safe pack hands FlashQLA metadata built by device ops with sizes from shapes only (``flashqla_cu``),
so one capture replays any layout, as with fla. A graph-safe pack takes FlashQLA only at ``GRAPH_SAFE_FLASHQLA_HEADS``
or more value heads per rank: it cannot use FlashQLA's intra-card CP, and without CP fewer heads run one long document
slower than fla's rule (and than native); below that the call keeps fla's rule, said once at INFO.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from gdn_compat._probe import FLASHQLA_METADATA
from gdn_compat.patches.gdn_thd.pack import CHUNK, Pack, chunk_indices, to_device

log = logging.getLogger("gdn_compat")
FLASHQLA_GPUS = ((9, 0), (10, 0), (10, 3))  # the sm90 / sm100 / sm103 kernels with a backward
_said: set[tuple[str, str]] = set()


@dataclasses.dataclass(frozen=True)
class Fast:
    flashqla: bool = False
    fused: bool = False
    flashqla_deterministic: bool = False  # the probe found FlashQLA's source free of atomics
    flashqla_graphs: bool = False  # the probe found FlashQLA taking chunk metadata attached to its offsets
    state_cp: bool = False  # patch gdn_cp_state: packed context parallelism passes the state between ranks

    def __bool__(self) -> bool:
        return self.flashqla or self.fused or self.state_cp

    def __or__(self, other: Fast) -> Fast:
        """Both sets of paths (the switches combine): every field of either."""
        return Fast(*(a or b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


NONE = Fast()  # the default paths only

EMPTY_PACK = "an empty pack (no tokens)"
# A graph-safe pack (capture, PackBuffer) cannot use FlashQLA's intra-card CP (its decision reads the offsets on the
# host), and without it one long document runs its chunks one after another per value head: FlashQLA's rule then takes
# about the same time at 16 value heads as at 32 (H200, one 32k document: 7.68 and 7.85 ms), where fla's, which also
# splits the value dim, scales with the heads (5.06 and 8.96 ms). Below this many value heads per rank a graph-safe
# pack runs fla's rule, the one native runs; at 32 and 64 FlashQLA's is the faster even on one document (#37).
GRAPH_SAFE_FLASHQLA_HEADS = 32
GRAPH_SAFE_FEW_HEADS = "a graph-safe pack"  # how that reason starts: note() says it at INFO


def note(path: str, reason: str, instead: str | None = None, quiet: bool = False) -> None:
    """Log once per process that a call did not take ``path``, which the user switched on, why, and what runs
    instead (by default the call as with that one switch off: the other switch stays on, so it is not "the default
    path"): a WARNING (the reason is the layer's, the GPU's or the install's, so every such call falls back), INFO for
    an empty pack, for a graph-safe pack of few value heads (a choice made for speed, not a shortfall) and where
    ``quiet`` (nothing the user can change falls back to a slower correct route)."""
    if (path, reason) not in _said:
        _said.add((path, reason))
        quiet = quiet or reason == EMPTY_PACK or reason.startswith(GRAPH_SAFE_FEW_HEADS)
        log.log(logging.INFO if quiet else logging.WARNING, "%s not used for a packed GDN call: %s; %s (said once per "
                "process)", path, reason, instead or f"such calls run as with {path} off")


def forget_notes() -> None:
    """Forget which fallbacks were said, so the next of each is logged again (tests and benchmarks that check a
    configuration's calls for fallbacks start from here)."""
    _said.clear()


@functools.lru_cache(maxsize=1)
def flashqla() -> Any:
    import flash_qla  # needs CUDA and tilelang at import; imported on the first call that could use it

    return flash_qla


CAPTURE_REFUSAL = ("gdn_compat gdn_flashqla: the installed FlashQLA does not take a pack's chunk metadata from its "
                   "offsets tensor ({why}), so it would size its kernels by a chunk count read on the host: a packed GDN "
                   "step through it cannot be captured in a CUDA graph that replays other layouts (nor take offsets "
                   "from a gdn_compat.graphs.PackBuffer); use a FlashQLA that does (flash-qla 0.1.3 does) or "
                   "apply(gdn_flashqla=False) for a captured step")


def flashqla_skip(fast: Fast, layer: Any, loc: Any, x: torch.Tensor, pack: Pack) -> str | None:
    """None when this call's delta rule runs through FlashQLA, else why not (logged by the caller)."""
    if not fast.flashqla:
        return "off"
    heads = loc.v // loc.dv
    if pack.cu_cpu is None and heads < GRAPH_SAFE_FLASHQLA_HEADS:
        return (f"{GRAPH_SAFE_FEW_HEADS} (CUDA-graph capture or a PackBuffer's offsets) at {heads} value heads per "
                f"rank: without the host offsets FlashQLA's intra-card CP cannot be decided, and without it "
                f"FlashQLA's rule is slower than fla's on one long document below {GRAPH_SAFE_FLASHQLA_HEADS} value "
                f"heads")
    if pack.cu_cpu is None and x.is_cuda and not fast.flashqla_graphs:
        raise RuntimeError(CAPTURE_REFUSAL.format(why="the probe's flashqla_metadata fact, read from "
                                                      "flash_qla/utils/index.py: python -m gdn_compat shows it"))
    if not x.is_cuda:
        return "FlashQLA needs a CUDA tensor"
    if x.shape[0] == 0:
        return EMPTY_PACK
    capability = tuple(torch.cuda.get_device_capability(x.device))
    if capability not in FLASHQLA_GPUS:
        return f"FlashQLA's kernels with a backward are for sm90/sm100/sm103, this GPU is sm_{capability[0]}{capability[1]}"
    if loc.dk != 128 or loc.dv != 128:
        return f"FlashQLA needs key and value head dims of 128, this layer has {loc.dk} and {loc.dv}"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"FlashQLA needs bf16 or fp16 activations, got {x.dtype}"
    if layer.config.deterministic_mode and not fast.flashqla_deterministic:
        return "deterministic_mode, and FlashQLA's source was not found free of atomics"
    try:
        flashqla()
    except Exception as exc:  # noqa: BLE001 - an unusable install is a reason, not a crash
        return f"flash_qla failed to import: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def flashqla_cu(pack: Pack) -> torch.Tensor:
    """A device copy of the pack's offsets (int64, as FlashQLA documents) that only FlashQLA sees, with its chunk
    metadata attached (``flash_qla.utils.index``: chunk size, chunk offsets, chunk count, chunk indices), so no
    launch of its kernels reads anything on the host. Host pack: FlashQLA's own ``prepare_varlen_metadata`` from
    the host offsets, kept for the pack's lifetime (FlashQLA caches by tensor identity, so it must never see a
    tensor whose values change). Device pack (graph-safe): built here by device ops with sizes from shapes only,
    the pack's fixed ``T // 64 + N + 1``-row chunk table (rows past the real chunks point at the appended empty
    sequence, which FlashQLA's chunked kernels mask like any chunk past a sequence's end) and that row count as
    the chunk count (it only sizes the chunk states of the backward, indexed by the per-sequence chunk offsets)."""
    key = ("flashqla_cu",)
    if key in pack.memo:
        return pack.memo[key]
    if pack.cu_cpu is None:
        size = _chunk_size()
        if size != CHUNK:
            raise RuntimeError(CAPTURE_REFUSAL.format(why=f"its chunk size on this GPU is {size}, gdn_compat's chunk "
                                                          f"table is for {CHUNK}"))
        cu = device_metadata(pack)
    else:
        cu = _with_metadata(pack.cu_cpu.to(torch.int64), pack.cu.device)  # FlashQLA documents LongTensor offsets
    pack.memo[key] = cu
    return cu


def _with_metadata(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of host offsets with FlashQLA's chunk metadata attached, where its layout has the helper."""
    cu = to_device(host, device)
    try:
        from flash_qla.utils.index import prepare_varlen_metadata
    except ImportError:  # an older layout: FlashQLA computes the metadata itself (one host read per pack)
        return cu
    return prepare_varlen_metadata(cu, host)


def flashqla_context(pack: Pack, num_v_heads: int) -> Any:
    """FlashQLA's intra-card context parallelism for this pack, or None for none (#37).

    FlashQLA can split a long sequence into segments that run side by side on the card (each segment's initial state
    recovered by a warm-up and a correction pass, exact up to rounding) where one sequence's chunks would otherwise
    run one after another on a few SMs. Whether that pays is its own cost model's call (``build_cp_context``: the
    calibrated ``autocp`` model, else its heuristic), from the chunk count of every sequence and the value heads.
    Host pack: decided here from the host offsets, so no device read, once per pack and head count; every
    tensor of the context is built on the host and copied to the device with FlashQLA's chunk metadata attached,
    and the same context serves the forward and the backward (they must agree on the split). Device pack (graph-safe:
    capture, ``PackBuffer``): never, because the decision reads the offsets; it runs as before, ``auto_cp=False``.
    Also None where the installed FlashQLA has no ``build_cp_context``."""
    if pack.cu_cpu is None:
        return None
    key = ("flashqla_context", num_v_heads)
    if key in pack.memo:
        return pack.memo[key]
    context = None
    try:
        from flash_qla.ops.gated_delta_rule.chunk.cp import build_cp_context
    except ImportError:
        build_cp_context = None
    if build_cp_context is not None:
        host = pack.cu_cpu.to(torch.int64)
        decided = build_cp_context(host, enable_intra=True, num_v_heads=num_v_heads, chunk_size=CHUNK, is_train=True)
        if decided.is_intra:
            device = pack.cu.device
            context = dataclasses.replace(
                decided, cu_seqlens=flashqla_cu(pack),
                intra_cp_cu_seqlens=_with_metadata(decided.intra_cp_cu_seqlens, device),
                **{name: to_device(getattr(decided, name), device)
                   for name in ("seq_map_r2c", "seq_map_c2r", "ht_mask", "ht_mask_bwd")})
            log.debug("gdn_compat gdn_flashqla: intra-card CP for a pack of %d sequences (longest %d tokens), "
                         "%d value heads: %d segments", len(pack.spans), max(b - a for a, b in pack.spans),
                         num_v_heads, decided.intra_cp_cu_seqlens.numel() - 1)
    pack.memo[key] = context
    return context


def device_metadata(pack: Pack) -> torch.Tensor:
    """The device pack's offsets for FlashQLA, int64, with its chunk metadata attached (see ``flashqla_cu``); device
    ops only, sizes from shapes. Zero-length entries are moved to the end first (a stable compaction: the same
    sequences in the same order, then empty ones at ``T``): FlashQLA's backward prefetches the row before an empty
    sequence's start, which for a leading empty entry would lie before its buffers. A new tensor every call, so no
    FlashQLA cache (they key on tensor identity) can hold it."""
    assert pack.chunks is not None  # every pack carries its chunk indices
    cu = pack.cu.to(torch.int64)
    repeated = torch.cat([cu.new_zeros(1, dtype=torch.bool), cu[1:] == cu[:-1]])
    cu = torch.sort(torch.where(repeated, cu[-1], cu)).values  # the distinct offsets in order, then T
    counts = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    chunk_offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    rows = pack.chunks.shape[0]  # T // 64 + N + 1: at least the chunks of any layout
    setattr(cu, FLASHQLA_METADATA, (CHUNK, chunk_offsets, rows, chunk_indices(cu, rows)))
    return cu


@functools.lru_cache(maxsize=1)
def _chunk_size() -> Any:
    """FlashQLA's chunk size on this process's GPU (64 on sm90/sm100), read once."""
    flashqla()
    import importlib

    return getattr(importlib.import_module("flash_qla.ops.gated_delta_rule.chunk"), "CHUNK_SIZE", None)


def flashqla_rule(query, key, value, g, beta, pack: Pack):
    """FlashQLA's public delta rule over the pack (q/k with the layer's key heads: no repeat)."""
    out, _ = flashqla().chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=None,
                                               output_final_state=False, use_qk_l2norm_in_kernel=False,
                                               cu_seqlens=flashqla_cu(pack), auto_cp=False,
                                               **cp_context(pack, value.shape[2]))
    return out


def cp_context(pack: Pack, num_v_heads: int) -> dict[str, Any]:
    """The keyword that hands FlashQLA the pack's intra-card CP context; none where there is no context (so a
    FlashQLA without the keyword is called as before)."""
    context = flashqla_context(pack, num_v_heads)
    return {} if context is None else {"cp_context": context}


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def norm_eps(eps: float | None, dtype: torch.dtype) -> float:
    """The epsilon an RMSNorm with ``eps`` applies to input of ``dtype``: ``torch.nn.RMSNorm(eps=None)`` (its
    default) takes the machine epsilon of the type it computes in, fp32 for bf16/fp16/fp32 input (fp64 for fp64),
    not that of the input's dtype (0.0078 for bf16)."""
    if eps is not None:
        return float(eps)
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def out_norm(layer: Any) -> tuple[torch.Tensor, float | None, bool] | str:
    """(weight, eps, zero_centered) of the layer's output RMSNorm, or why the fused norm does not know it; eps None:
    the norm's default, resolved per input dtype by ``norm_eps``."""
    norm, dv = layer.out_norm, layer.value_head_dim
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (dv,):
        return f"out_norm {type(norm).__qualname__} has no weight of shape ({dv},)"
    if isinstance(norm, torch.nn.RMSNorm):
        if type(norm).forward is not torch.nn.RMSNorm.forward:  # a subclass that computes something else
            return (f"out_norm {type(norm).__module__}.{type(norm).__qualname__} overrides torch.nn.RMSNorm.forward; "
                    f"the fused gated norm computes torch's RMSNorm only")
        return weight, norm.eps, False
    te = type(norm).__module__.startswith("transformer_engine") and type(norm).__name__ == "RMSNorm"
    if te and isinstance(getattr(norm, "eps", None), float):
        return weight, norm.eps, bool(getattr(norm, "zero_centered_gamma", False))
    return (f"out_norm is a {type(norm).__module__}.{type(norm).__qualname__}; the fused gated norm knows "
            f"torch.nn.RMSNorm and Transformer Engine's RMSNorm")


def fused_skip(fast: Fast, layer: Any, loc: Any, x: torch.Tensor) -> str | None:
    """None when this call's region runs through gdn_compat's fused kernels, else why not."""
    if not fast.fused:
        return "off"
    from gdn_compat import fused

    why = fused.unavailable()
    if why:
        return why
    if not x.is_cuda and not fused.interpreted():
        return "the fused kernels need a CUDA tensor (or Triton's interpreter: TRITON_INTERPRET=1)"
    if layer.activation not in ("silu", "swish"):
        return f"the fused conv applies SiLU, this layer's activation is {layer.activation!r}"
    if not (_pow2(loc.dk) and _pow2(loc.dv) and loc.dk <= 256 and loc.dv <= 256):
        return f"the fused kernels need power-of-2 head dims up to 256, this layer has {loc.dk} and {loc.dv}"
    if loc.conv_w.shape[-1] > 8:
        return f"the fused conv handles widths up to 8, this layer's is {loc.conv_w.shape[-1]}"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the fused kernels take bf16, fp16 or fp32, got {x.dtype}"
    found = out_norm(layer)
    return found if isinstance(found, str) else None
