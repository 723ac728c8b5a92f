"""The pack: validated sequence boundaries of a THD micro-batch, on host and device, cached per pack.

Every GDN layer of a micro-batch receives the same ``PackedSeqParams``; the boundaries are validated
and copied to the host once (one device-to-host copy per pack) and handed to fla as
``cu_seqlens_cpu``, so a layer call itself never syncs.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch

from gdn_compat.patches.gdn_thd import context_parallel as cpx


@dataclasses.dataclass(frozen=True)
class Pack:
    cu: torch.Tensor  # device cu_seqlens handed to fla (zero-length sequences removed)
    cu_cpu: torch.Tensor  # the same offsets on the host
    spans: tuple[tuple[int, int], ...]  # (start, end) of every non-empty sequence
    perm: torch.Tensor | None = None  # context parallel: received rows -> global token order
    inverse: torch.Tensor | None = None  # and back


def _resolve(psp: Any, side: str) -> tuple[str, torch.Tensor | None]:
    padded = getattr(psp, f"cu_seqlens_{side}_padded", None)
    if padded is not None:
        return f"cu_seqlens_{side}_padded", padded
    return f"cu_seqlens_{side}", getattr(psp, f"cu_seqlens_{side}", None)


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
    """Last few packs, keyed by the identity *and* in-place version of their cu_seqlens tensors,
    so every GDN layer of a micro-batch shares one validation and one host copy, while a tensor
    modified in place is never served stale."""

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: list[tuple[Any, ...]] = []

    @staticmethod
    def _key(tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        return tuple((weakref.ref(t), t._version) for t in tensors)

    def get(self, tensors: tuple[torch.Tensor, ...], total: int, scope: Any) -> Pack | None:
        for key, k_total, k_scope, pack in self.entries:
            if (k_total == total and k_scope == scope and len(key) == len(tensors)
                    and all(r() is t and v == t._version for (r, v), t in zip(key, tensors))):
                return pack
        return None

    def put(self, tensors: tuple[torch.Tensor, ...], total: int, scope: Any, pack: Pack) -> None:
        self.entries = [e for e in self.entries if all(r() is not None for r, _ in e[0])]
        self.entries.insert(0, (self._key(tensors), total, scope, pack))  # scope: (device, cp)
        del self.entries[self.size:]

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


def _validate(q_name: str, q_host: list[int], total: int, cp: int) -> list[int]:
    """The sequence lengths of host offsets ``q_host``, or a ValueError naming what is wrong."""
    if q_host[0] != 0:
        raise ValueError(f"gdn_compat THD: {q_name} must start at 0, got {q_host}")
    if any(b < a for a, b in zip(q_host, q_host[1:])):
        raise ValueError(f"gdn_compat THD: {q_name} must be non-decreasing, got {q_host}")
    if q_host[-1] != total:
        raise ValueError(f"gdn_compat THD: {q_name}[-1]={q_host[-1]} does not match the pack's token count "
                         f"{total} (local tokens x sequence-parallel size x context-parallel size); {q_name}={q_host}")
    lengths = [b - a for a, b in zip(q_host, q_host[1:])]
    if cp > 1 and any(n % (2 * cp) for n in lengths):
        raise ValueError(f"gdn_compat THD with context parallel size {cp}: every sequence length must be "
                         f"divisible by 2 x cp = {2 * cp} (Megatron's load balancing); offending lengths "
                         f"{[n for n in lengths if n % (2 * cp)]} in {q_name}={q_host}")
    return lengths


def pack_for(psp: Any, total: int, device: torch.device, cp: int = 1) -> Pack:
    """Validate ``packed_seq_params`` for a pack of ``total`` tokens; cached per pack."""
    q_name, q = _resolve(psp, "q")
    kv_name, kv = _resolve(psp, "kv")
    if q is None:
        raise ValueError("gdn_compat THD: packed_seq_params has neither cu_seqlens_q_padded nor cu_seqlens_q")
    _check_tensor(q_name, q, device)
    tensors: tuple[torch.Tensor, ...] = (q,)
    if kv is not None and kv is not q:
        _check_tensor(kv_name, kv, device)
        tensors = (q, kv)
    hit = PACKS.get(tensors, total, (device, cp))
    if hit is not None:
        return hit
    # The single device-to-host copy of this pack (none when the offsets already live on the host).
    host = torch.cat([t.detach().to("cpu", torch.int64) for t in tensors]).tolist()
    q_host, kv_host = host[: q.numel()], host[q.numel():]
    if kv_host and kv_host != q_host:
        raise ValueError(f"gdn_compat THD: {q_name}={q_host} and {kv_name}={kv_host} differ; "
                         f"GatedDeltaNet needs one set of sequence boundaries")
    lengths = _validate(q_name, q_host, total, cp)
    spans = tuple((a, b) for a, b in zip(q_host, q_host[1:]) if b > a)
    offsets = [0] + [b for _, b in spans]
    cu_cpu = torch.tensor(offsets, dtype=q.dtype)
    if len(offsets) == q.numel() and q.device == device:
        cu = q  # nothing dropped: hand the caller's own tensor to fla, as upstream does
    else:
        cu = to_device(cu_cpu, device)
    perm, inverse = _cp_perm(lengths, cp, device)
    pack = Pack(cu=cu, cu_cpu=cu_cpu, spans=spans, perm=perm, inverse=inverse)
    PACKS.put(tensors, total, (device, cp), pack)
    return pack


@functools.lru_cache(maxsize=16)
def rows_pack(length: int, rows: int, cp: int, device: torch.device) -> Pack:
    """Unpacked [s, b] input under context parallelism: b sequences of ``length`` tokens."""
    offsets = [i * length for i in range(rows + 1)]
    cu_cpu = torch.tensor(offsets, dtype=torch.int32)
    perm, inverse = _cp_perm([length], cp, device)
    spans = tuple(zip(offsets, offsets[1:]))
    return Pack(cu=to_device(cu_cpu, device), cu_cpu=cu_cpu, spans=spans, perm=perm, inverse=inverse)
