"""CUDA graphs for packed GDN training steps that survive a new pack every step.

A captured graph replays fixed shapes, so a pack's layout must live in static buffers whose *shapes*
never change: ``PackBuffer(tokens, max_sequences)`` holds offsets of exactly ``max_sequences + 1``
entries for exactly ``tokens`` tokens, and ``load()`` writes each step's layout into them, padded with
repeats of ``tokens`` (zero-length sequences, which every kernel skips). Offsets held in a PackBuffer
always take gdn_compat's graph-safe packed path (no host read, chunk indices of a fixed length), in
eager warm-up, in capture and in replay alike::

    buf = gdn_compat.graphs.PackBuffer(tokens=8192, max_sequences=16, device="cuda")
    buf.load(cu_seqlens_of_this_step)            # host check, then one copy into the buffer
    graph, loss = gdn_compat.graphs.capture(step)  # step: zero_grad(set_to_none) + fwd + bwd on static inputs
    for batch in loader:                         # a new layout every step, one capture
        buf.load(batch.cu_seqlens); ids.copy_(batch.ids); ...; graph.replay(); optimizer.step()

``load()`` is where bad offsets are refused, with a clear error, before any kernel runs. A pack with
fewer tokens than the budget must be padded to it (``pad_to(cu_seqlens, tokens)`` appends a padding
sequence whose labels the caller masks; ``pad_to(real, tokens, padded=slots)`` for a padded pack). Needs
gdn_compat's packed GDN: ``gdn_thd`` on 0.16/0.17, the opt-in ``gdn_thd_graph_safe`` or ``gdn_fused`` on 0.18/0.19.
Context parallelism (cp > 1) cannot use a PackBuffer: its load balancing is built on the host per pack.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gdn_compat.patches.gdn_thd.pack import STATIC

__all__ = ["PackBuffer", "capture", "pad_to"]


def _host_offsets(name: str, offsets: Any) -> list[int]:
    """``offsets`` (a 1-D int32/int64 tensor, an integer numpy array or a sequence of ints) as a list of ints."""
    if isinstance(offsets, torch.Tensor):
        if offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() != 1:
            raise TypeError(f"gdn_compat.graphs: {name} must be a 1-D int32/int64 tensor or a list of ints, got "
                            f"{offsets.dtype} of shape {tuple(offsets.shape)}")
        offsets = offsets.tolist()  # a host copy: load() runs between steps, not inside a graph
    if isinstance(offsets, (str, bytes)) or not hasattr(offsets, "__iter__"):
        raise TypeError(f"gdn_compat.graphs: {name} must be a 1-D int32/int64 tensor, an integer numpy array or a "
                        f"sequence of ints, got {type(offsets).__name__}: {offsets!r}")
    if getattr(offsets, "ndim", 1) != 1:
        raise TypeError(f"gdn_compat.graphs: {name} must be 1-D, got shape {getattr(offsets, 'shape', '?')}")
    values = list(offsets)
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and type(v).__name__ != "bool_"
               for v in values):
        raise TypeError(f"gdn_compat.graphs: {name} must hold integers, got {values!r}")
    values = [int(v) for v in values]
    if len(values) < 2 or values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"gdn_compat.graphs: {name} must start at 0, not decrease and hold at least 2 offsets; "
                         f"got {values}")
    return values


def pad_to(cu_seqlens: Sequence[int] | torch.Tensor, tokens: int, *,
           padded: Sequence[int] | torch.Tensor | None = None) -> Any:
    """Offsets of a pack padded to a budget of ``tokens`` by one more sequence holding the padding. Its
    tokens run through the model (the cost of a fixed budget); mask their labels out of the loss.

    For a pack laid out in padded slots, pass the slots too: ``real, slots = pad_to(real, tokens, padded=slots)``
    returns both, the padding sequence filling its slot (then ``buf.load(real, slots)``)."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise TypeError(f"gdn_compat.graphs.pad_to: tokens must be an int >= 0, got {tokens!r}")
    values = _host_offsets("cu_seqlens", cu_seqlens)
    layout = values if padded is None else _host_offsets("padded", padded)
    if layout[-1] > tokens:
        raise ValueError(f"gdn_compat.graphs: the pack holds {layout[-1]} tokens, more than the budget {tokens}")
    if padded is None:
        return values if values[-1] == tokens else [*values, tokens]
    if len(layout) != len(values):
        raise ValueError(f"gdn_compat.graphs.pad_to: cu_seqlens has {len(values)} offsets but padded {len(layout)}")
    if layout[-1] == tokens:
        return values, layout
    return [*values, values[-1] + tokens - layout[-1]], [*layout, tokens]


class PackBuffer:
    """Static offsets for a captured packed step: packs of exactly ``tokens`` tokens in at most
    ``max_sequences`` sequences. ``params`` is the ``PackedSeqParams`` to hand the model (the same object
    every step); with ``padded=True`` it also carries ``cu_seqlens_q_padded`` for packs whose sequences
    sit in padded slots (real lengths in ``cu_seqlens_q``)."""

    def __init__(self, tokens: int, max_sequences: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.int32, padded: bool = False):
        if not (isinstance(tokens, int) and tokens >= 0 and isinstance(max_sequences, int) and max_sequences >= 1):
            raise ValueError(f"gdn_compat.graphs.PackBuffer: tokens must be an int >= 0 and max_sequences an int "
                             f">= 1; got tokens={tokens!r}, max_sequences={max_sequences!r}")
        if dtype not in (torch.int32, torch.int64):
            raise TypeError(f"gdn_compat.graphs.PackBuffer: dtype must be torch.int32 or torch.int64 (the offsets' "
                            f"type in PackedSeqParams), got {dtype}")
        _require_graph_safe_gdn()
        from megatron.core.packed_seq_params import PackedSeqParams

        self.tokens, self.max_sequences, self.padded = tokens, max_sequences, padded
        device = torch.device(device if device is not None else "cuda")
        first = [0] + [tokens] * max_sequences  # one sequence filling the pack
        self.cu_seqlens = torch.tensor(first, dtype=dtype, device=device)
        self.cu_seqlens_padded = self.cu_seqlens.clone() if padded else None
        for t in (self.cu_seqlens, self.cu_seqlens_padded):
            if t is not None:
                STATIC[id(t)] = t
        self.params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded, cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=tokens, max_seqlen_kv=tokens)

    def load(self, cu_seqlens: Sequence[int] | torch.Tensor,
             cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None) -> None:
        """Write one step's layout into the buffers (checked on the host first: a pack of another token
        count or with more sequences than the capture's raises here, before any kernel runs)."""
        real = _host_offsets("cu_seqlens", cu_seqlens)
        if (cu_seqlens_padded is not None) != self.padded:
            raise ValueError(f"gdn_compat.graphs.PackBuffer(padded={self.padded}): load() "
                             + ("needs cu_seqlens_padded" if self.padded else "got cu_seqlens_padded; build the "
                                "buffer with padded=True for packs laid out in padded slots"))
        layout = real if cu_seqlens_padded is None else _host_offsets("cu_seqlens_padded", cu_seqlens_padded)
        n = len(layout) - 1
        if n > self.max_sequences:
            raise ValueError(f"gdn_compat.graphs.PackBuffer: the pack has {n} sequences but the buffer (and the "
                             f"captured graph) holds at most {self.max_sequences}; build a PackBuffer with "
                             f"max_sequences >= {n} and capture again")
        if layout[-1] != self.tokens:
            raise ValueError(f"gdn_compat.graphs.PackBuffer: the pack holds {layout[-1]} tokens but the buffer (and "
                             f"the captured graph) holds exactly {self.tokens}; pad the pack to the budget "
                             f"(gdn_compat.graphs.pad_to) or capture one graph per token budget")
        if self.padded:
            if len(real) != len(layout):
                raise ValueError(f"gdn_compat.graphs.PackBuffer: cu_seqlens has {len(real)} offsets but "
                                 f"cu_seqlens_padded {len(layout)}")
            slots = [(b - a, d - c) for a, b, c, d in zip(real, real[1:], layout, layout[1:])]
            if any(length > slot for length, slot in slots):
                raise ValueError(f"gdn_compat.graphs.PackBuffer: a real length exceeds its padded slot "
                                 f"(cu_seqlens={real}, cu_seqlens_padded={layout}); to pad a padded pack to the budget "
                                 f"use real, slots = gdn_compat.graphs.pad_to(real, tokens, padded=slots)")
            self._write(self.cu_seqlens_padded, layout, self.tokens)
            self._write(self.cu_seqlens, real, real[-1])
        else:
            self._write(self.cu_seqlens, layout, self.tokens)

    def _write(self, buffer: torch.Tensor | None, values: list[int], fill: int) -> None:
        assert buffer is not None
        full = values + [fill] * (self.max_sequences + 1 - len(values))
        with torch.no_grad():
            buffer.copy_(torch.tensor(full, dtype=buffer.dtype))


def capture(step: Callable[[], Any], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``step`` up on a side stream (Triton autotuning, torch.compile, allocations), then record it in
    one CUDA graph; returns (graph, what the captured call returned, in static memory). ``step`` runs the
    model's forward and backward on static inputs and starts with ``model.zero_grad(set_to_none=True)``,
    so the gradients are allocated in the graph's pool and every replay overwrites them: read them after
    ``replay()`` and do not set them to None between replays."""
    if not torch.cuda.is_available():
        raise RuntimeError("gdn_compat.graphs.capture: CUDA graphs need a CUDA device, and torch sees none "
                           "(torch.cuda.is_available() is False); run the step eagerly on this machine")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def _require_graph_safe_gdn() -> None:
    applied = _patched_forward()
    if not applied & {"gdn_thd", "gdn_thd_graph_safe", "gdn_fused", "gdn_flashqla"}:
        raise RuntimeError("gdn_compat.graphs.PackBuffer needs gdn_compat's packed GDN path applied first: "
                           "gdn_compat.apply() on megatron-core 0.16/0.17 (gdn_thd), "
                           "gdn_compat.apply(gdn_thd_graph_safe=True) or apply(gdn_fused=True) on 0.18/0.19 (their "
                           "native THD reads the offsets on the host and cannot be captured, upstream #6796); "
                           f"applied now: {sorted(applied) or 'none'}")


def _patched_forward() -> set[str]:
    """The gdn_compat patches installed on ``GatedDeltaNet.forward`` now, read from the class: each replacement carries
    its patch's name and wraps (``__wrapped__``) what it replaced."""
    import importlib

    from gdn_compat._probe import GDN_MODULE
    from gdn_compat._registry import MARKER

    try:
        forward = vars(importlib.import_module(GDN_MODULE).GatedDeltaNet).get("forward")
    except Exception:  # noqa: BLE001 - no GatedDeltaNet: nothing installed on it
        return set()
    found = set()
    while forward is not None and getattr(forward, MARKER, None):
        found.add(getattr(forward, MARKER))
        forward = getattr(forward, "__wrapped__", None)
    return found
