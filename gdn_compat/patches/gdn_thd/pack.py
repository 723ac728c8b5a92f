"""The pack: validated sequence boundaries of a THD micro-batch, and fla's chunk indices for them.

Two ways to make one, chosen in ``pack_for`` and nowhere else:

* host pack (eager, the default): every GDN layer of a micro-batch receives the same
  ``PackedSeqParams``; the boundaries are validated and copied to the host once (one device-to-host
  copy per pack, cached), zero-length sequences dropped, and the chunk indices built once;
* device pack (graph-safe: under CUDA-graph capture, or for offsets held in a
  ``gdn_compat.graphs.PackBuffer``): nothing is read on the host and nothing is cached, every size
  comes from shapes: the offsets plus an appended empty sequence, and a chunk-index table of a fixed
  ``T // 64 + N + 1`` rows whose rows past the real chunks point at that empty sequence (which every
  fla kernel masks). One capture then replays any layout of ``T`` tokens in ``N`` offsets
  (upstream #6796 names the blockers this removes). Offsets are checked by a device-side assert and
  clamped, so bad offsets crash loudly instead of reading out of bounds.

Either way the kernels get ``cu`` and ``chunks`` and run the same code (``kernels.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch

from gdn_compat.patches.gdn_thd import context_parallel as cpx

CHUNK = 64  # fla's chunk size for the gated delta rule and its varlen conv


@dataclasses.dataclass(frozen=True)
class Pack:
    cu: torch.Tensor  # device cu_seqlens handed to fla (host pack: zero-length sequences removed)
    cu_cpu: torch.Tensor | None  # the same offsets on the host; None for a device pack
    spans: tuple[tuple[int, int], ...]  # (start, end) of every non-empty sequence (its padded slot); host pack
    ends: tuple[int, ...] = ()  # where each span's real tokens end (cu_seqlens_q; < end when padded)
    chunks: torch.Tensor | None = None  # [rows, 2] (sequence, chunk) of every 64-token chunk, for fla
    real_ends: torch.Tensor | None = None  # device pack: where each sequence of ``cu`` has its last real token
    perm: torch.Tensor | None = None  # context parallel: received rows -> global token order
    # the caller's offsets hold zero-length entries (host pack: dropped from ``cu``); a device pack may: True
    empty_entries: bool = False
    inverse: torch.Tensor | None = None  # and back
    # what other users of the same pack derive from it once (the MTP roll's index), by their own key
    memo: dict[Any, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)


FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def _check_tensor(name: str, t: Any, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gdn_compat THD: {name} must be a torch.Tensor of int32/int64 offsets, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"gdn_compat THD: {name} has dtype {t.dtype}; expected torch.int32 or torch.int64")
    if t.dim() != 1 or t.numel() < 2:
        raise ValueError(f"gdn_compat THD: {name} must be 1-D with at least 2 offsets, got shape {tuple(t.shape)}")
    if t.device.type != "cpu" and t.device != device:
        raise ValueError(f"gdn_compat THD: {name} is on {t.device} but hidden_states are on {device}; "
                         f"expected a host tensor or one on {device}")


class PackCache:
    """The last few packs, so every GDN layer of a micro-batch shares one validation and one host copy.

    The contract, per offsets tensor:
    * on the host: compared by value on every call (no device cost), so no write, tracked or not
      (``.data``, ``.numpy()``, ``torch.from_numpy``), can serve a stale pack;
    * on the device: reading values would cost a sync per layer, so the key is the tensor's identity
      and in-place version: a new tensor or a tracked in-place op is seen. Writes that bypass
      autograd's version counter (``.data``, DLPack) must not change a device offsets tensor once it
      was used; hand the layers a new tensor instead. Inference tensors (``torch.inference_mode()``)
      have no version counter and are never cached on the device: they are read on every call.
    * a pack made inside ``torch.inference_mode()`` (its tensors are inference tensors) is served only inside it,
      and one made outside only outside: an evaluation pass never hands a training step tensors it cannot save.
    """

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: list[tuple[tuple[Any, ...], tuple[weakref.ref, ...], Pack]] = []

    @staticmethod
    def key(given: dict[str, torch.Tensor], total: int, device: torch.device,
            cp: int) -> tuple[tuple[Any, ...], tuple[weakref.ref, ...]] | None:
        """(key, weak references to the device tensors it names), or None: not cacheable."""
        # a pack made under torch.inference_mode() holds inference tensors, which a later autograd step cannot
        # save for backward: packs of the two modes never serve each other (#41)
        parts: list[Any] = [total, device, cp, torch.is_inference_mode_enabled()]
        refs = []
        for name, t in given.items():
            if t.device.type == "cpu":
                parts.append((name, tuple(t.tolist())))
            elif t.is_inference():
                return None
            else:
                parts.append((name, id(t), t._version))
                refs.append(weakref.ref(t))
        return tuple(parts), tuple(refs)

    def _live(self) -> list[tuple[tuple[Any, ...], tuple[weakref.ref, ...], Pack]]:
        # an entry whose device tensor died is dropped before its id() could be reused
        return [e for e in self.entries if all(r() is not None for r in e[1])]

    def get(self, key: tuple[tuple[Any, ...], tuple[weakref.ref, ...]] | None) -> Pack | None:
        if key is None:
            return None
        self.entries = self._live()
        return next((pack for k, _, pack in self.entries if k == key[0]), None)

    def put(self, key: tuple[tuple[Any, ...], tuple[weakref.ref, ...]] | None, pack: Pack) -> None:
        if key is not None:
            self.entries = [(key[0], key[1], pack), *self._live()][: self.size]

    def clear(self) -> None:
        self.entries.clear()


PACKS = PackCache()


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _cp_perm(lengths: list[int], cp: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if cp == 1:
        return None, None
    perm = cpx.load_balance_perm(lengths, cp)
    return to_device(perm, device), to_device(torch.argsort(perm), device)


def _check_offsets(name: str, offsets: list[int]) -> None:
    if offsets[0] != 0:
        raise ValueError(f"gdn_compat THD: {name} must start at 0, got {offsets}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"gdn_compat THD: {name} must be non-decreasing, got {offsets}")


def _layout(host: dict[str, list[int]], total: int, cp: int) -> tuple[str, list[int]]:
    """The offsets the tokens are laid out by (padded when given), checked like with like."""
    for a, b in (("cu_seqlens_q", "cu_seqlens_kv"), ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
        if a in host and b in host and host[a] != host[b]:
            raise ValueError(f"gdn_compat THD: {a}={host[a]} and {b}={host[b]} differ; "
                             f"GatedDeltaNet needs one set of sequence boundaries")
    name = "cu_seqlens_q_padded" if "cu_seqlens_q_padded" in host else "cu_seqlens_q"
    layout = host[name]
    _check_offsets(name, layout)
    if layout[-1] != total:
        raise ValueError(f"gdn_compat THD: {name}[-1]={layout[-1]} does not match the pack's token count "
                         f"{total} (local tokens x sequence-parallel size x context-parallel size); {name}={layout}")
    actual = host.get("cu_seqlens_q") if name == "cu_seqlens_q_padded" else None
    if actual is not None:
        _check_offsets("cu_seqlens_q", actual)
        lengths = [b - a for a, b in zip(actual, actual[1:])]
        slots = [b - a for a, b in zip(layout, layout[1:])]
        if len(lengths) != len(slots) or any(n > s for n, s in zip(lengths, slots)):
            raise ValueError(f"gdn_compat THD: cu_seqlens_q={actual} does not fit cu_seqlens_q_padded={layout}: "
                             f"every sequence's actual length must fit its padded slot (lengths {lengths}, "
                             f"slots {slots})")
    lengths = [b - a for a, b in zip(layout, layout[1:])]
    if cp > 1 and any(n % (2 * cp) for n in lengths):
        raise ValueError(f"gdn_compat THD with context parallel size {cp}: every sequence length must be "
                         f"divisible by 2 x cp = {2 * cp} (Megatron's load balancing); offending lengths "
                         f"{[n for n in lengths if n % (2 * cp)]} in {name}={layout}")
    return name, layout


def chunk_indices(cu: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 2] (sequence, chunk) of every ``CHUNK``-token chunk of the pack ``cu``, in order, as fla's
    ``prepare_chunk_indices`` lays them out, computed with device ops only (no host read). Zero-length
    sequences get no row and keep their own index (fla's ``prepare_chunk_indices`` numbers sequences by
    their first chunks, so it would shift every later sequence onto an empty one). Rows past the real
    chunks point at chunk 0 of the last sequence, which must then be empty."""
    bounds = cu.to(torch.int64)
    if bounds.numel() < 2:  # no sequence at all (an empty host pack)
        return cu.new_zeros(rows, 2)
    count = (bounds[1:] - bounds[:-1] + CHUNK - 1) // CHUNK
    ends = torch.cumsum(count, 0)
    row = torch.arange(rows, device=cu.device)
    seq = torch.searchsorted(ends, row, right=True).clamp_(max=count.numel() - 1)
    chunk = torch.where(row < ends[-1], row - (ends - count)[seq], 0)
    return torch.stack([seq, chunk], 1).to(cu.dtype)


# Offsets tensors that live in a gdn_compat.graphs.PackBuffer: always given a device pack, so warm-up,
# capture and eager reference runs take the same path. id -> tensor (Tensor equality is elementwise).
STATIC: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def graph_safe(given: dict[str, torch.Tensor]) -> bool:
    """The one place that chooses the device pack: while a CUDA graph is being captured, or for offsets
    held in a PackBuffer."""
    if any(STATIC.get(id(t)) is t for t in given.values()):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def device_pack(given: dict[str, torch.Tensor], total: int, device: torch.device, cp: int) -> Pack:
    """The graph-safe pack: every size from shapes, no host read, no cache (see the module docstring)."""
    if cp > 1:
        raise NotImplementedError(
            f"gdn_compat THD: a graph-safe pack (under CUDA-graph capture, or offsets held in a "
            f"gdn_compat.graphs.PackBuffer) is not supported with context parallel size {cp}: the load-balancing "
            f"permutation is built on the host per pack. At cp > 1 hand the model a plain PackedSeqParams (a new one "
            f"per step is fine) and do not capture; capture only at cp = 1")
    name = "cu_seqlens_q_padded" if "cu_seqlens_q_padded" in given else "cu_seqlens_q"
    for other in given.values():
        if other.device != device:
            raise ValueError(f"gdn_compat THD: under CUDA-graph capture the offsets must live on {device} "
                             f"(a static buffer, e.g. gdn_compat.graphs.PackBuffer), got a tensor on {other.device}")
    layout = given[name].to(torch.int64)
    checks = [layout[0] == 0, layout[-1] == total, (layout[1:] >= layout[:-1]).all()]
    for a, b in (("cu_seqlens_q", "cu_seqlens_kv"), ("cu_seqlens_q_padded", "cu_seqlens_kv_padded")):
        if a in given and b in given and given[b] is not given[a]:
            if given[a].shape != given[b].shape:
                raise ValueError(f"gdn_compat THD: {a} has shape {tuple(given[a].shape)} and {b} "
                                 f"{tuple(given[b].shape)}; GatedDeltaNet needs one set of sequence boundaries")
            checks.append((given[a] == given[b]).all())
    bounds = torch.cat([layout.clamp(0, total).cummax(0).values, layout.new_full((1,), total)])
    real = bounds[1:-1]  # where each sequence's real tokens end: its slot's end, unless padded
    if name == "cu_seqlens_q_padded" and "cu_seqlens_q" in given:
        actual = given["cu_seqlens_q"].to(torch.int64)
        if actual.shape != layout.shape:
            raise ValueError(f"gdn_compat THD: cu_seqlens_q has shape {tuple(actual.shape)} but cu_seqlens_q_padded "
                             f"{tuple(layout.shape)}; every sequence needs a padded slot")
        lengths = actual[1:] - actual[:-1]
        checks += [actual[0] == 0, (lengths >= 0).all(), (lengths <= layout[1:] - layout[:-1]).all()]
        real = torch.minimum(bounds[:-2] + lengths.clamp(min=0), real)
    ok = torch.stack(checks).all()
    torch._assert_async(ok, f"gdn_compat THD: invalid offsets for a pack of {total} tokens: {name} must start at 0, "
                            f"not decrease and end at {total}, and every real length must fit its slot")
    cu = bounds.to(given[name].dtype)
    rows = total // CHUNK + layout.numel()  # T // 64 + N + 1 rows hold the chunks of any layout (+ 1 spare)
    return Pack(cu=cu, cu_cpu=None, spans=(), chunks=chunk_indices(cu, rows),
                real_ends=torch.cat([real, bounds[-1:]]), empty_entries=True)


def pack_for(psp: Any, total: int, device: torch.device, cp: int = 1) -> Pack:
    """Validate ``packed_seq_params`` for a pack of ``total`` tokens: a host pack cached per pack (see
    PackCache), or, while capturing a CUDA graph or for a PackBuffer's offsets, a device pack."""
    given = {name: t for name in FIELDS if (t := getattr(psp, name, None)) is not None}
    if "cu_seqlens_q" not in given and "cu_seqlens_q_padded" not in given:
        raise ValueError("gdn_compat THD: packed_seq_params has neither cu_seqlens_q_padded nor cu_seqlens_q")
    for name, t in given.items():
        _check_tensor(name, t, device)
    if graph_safe(given):
        return device_pack(given, total, device, cp)
    key = PACKS.key(given, total, device, cp)
    hit = PACKS.get(key)
    if hit is not None:
        return hit
    # The single device-to-host copy of this pack (none when the offsets already live on the host).
    flat = torch.cat([t.detach().to("cpu", torch.int64) for t in given.values()]).tolist()
    host, at = {}, 0
    for name, t in given.items():
        host[name], at = flat[at: at + t.numel()], at + t.numel()
    name, layout = _layout(host, total, cp)
    actual = host.get("cu_seqlens_q", layout) if name == "cu_seqlens_q_padded" else layout
    slots = [(a, b, a + n1 - n0) for a, b, n0, n1 in zip(layout, layout[1:], actual, actual[1:]) if b > a]
    spans, ends = tuple((a, b) for a, b, _ in slots), tuple(e for _, _, e in slots)
    offsets = [0] + [b for _, b in spans]
    source = given[name]
    cu_cpu = torch.tensor(offsets, dtype=source.dtype)
    # nothing dropped: hand the caller's own tensor to fla, as upstream does
    cu = source if len(offsets) == source.numel() and source.device == device else to_device(cu_cpu, device)
    perm, inverse = _cp_perm([b - a for a, b in zip(layout, layout[1:])], cp, device)
    chunks = to_device(chunk_indices(cu_cpu, sum(-(-(b - a) // CHUNK) for a, b in spans)), device)
    pack = Pack(cu=cu, cu_cpu=cu_cpu, spans=spans, ends=ends, chunks=chunks, perm=perm, inverse=inverse,
                empty_entries=len(offsets) != len(layout))
    PACKS.put(key, pack)
    return pack


def rows_pack(length: int, rows: int, cp: int, device: torch.device) -> Pack:
    """Unpacked [s, b] input under context parallelism: b sequences of ``length`` tokens (cached per inference
    mode, as ``PackCache`` is)."""
    return _rows_pack(length, rows, cp, device, torch.is_inference_mode_enabled())


@functools.lru_cache(maxsize=16)
def _rows_pack(length: int, rows: int, cp: int, device: torch.device, inference: bool) -> Pack:
    perm, inverse = _cp_perm([length], cp, device)
    return dataclasses.replace(host_pack([i * length for i in range(rows + 1)], device), perm=perm, inverse=inverse)


def host_pack(offsets: list[int], device: torch.device) -> Pack:
    """A pack of non-empty sequences at host ``offsets``, no context parallelism (each batch row of an unpacked
    input; each of a rank's slots under gdn_cp_state): its offsets and chunk indices copied to ``device`` once."""
    cu_cpu = torch.tensor(offsets, dtype=torch.int32)
    spans = tuple(zip(offsets, offsets[1:]))
    chunks = to_device(chunk_indices(cu_cpu, sum(-(-(b - a) // CHUNK) for a, b in spans)), device)
    return Pack(cu=to_device(cu_cpu, device), cu_cpu=cu_cpu, spans=spans, ends=tuple(offsets[1:]), chunks=chunks)
