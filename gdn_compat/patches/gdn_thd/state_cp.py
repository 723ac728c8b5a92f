"""Context parallelism that passes the delta rule's recurrent state between ranks (#56): the math, in torch.

Every release's GDN context parallelism (and gdn_compat's on 0.16/0.17, ``context_parallel.py``) exchanges heads
for tokens with an all-to-all: each rank then runs whole sequences for ``heads / cp`` of the heads, so cp is capped
by the value heads a tensor-parallel rank holds, and every rank still runs the whole sequence through the rule.
Here each rank keeps its own tokens and every head.

The layout is megatron's load-balanced THD CP layout, as its data path produces it: every sequence of (padded)
length ``L`` is cut into ``2 x cp`` slots of ``L / (2 cp)`` tokens, and rank ``r`` holds slots ``r`` and
``2cp-1-r`` of every sequence, back to back, sequences in order. A sequence's slots run in order 0 .. 2cp-1, so its
state visits ranks 0, 1, .., cp-1, cp-1, .., 1, 0.

* **The conv** needs the ``width - 1`` tokens of the sequence before each slot (its halo). Each rank sends the last
  ``width - 1`` tokens of its slots; every rank chains them (a slot shorter than the halo takes the rest from the
  slots before it). One small all_gather.
* **The delta rule** ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` (state ``[K, V]`` per
  head) is affine in the state a slot starts from: ``S_t = P_t S_in + S_t^0``, with ``P_t`` ``[K, K]`` the product
  of the slot's transitions up to ``t`` and ``S_t^0`` its state from a zero start; its output ``o_t = scale S_t^T q_t``
  is then ``o_t^0 + (scale P_t^T q_t)^T S_in``. One run of the rule per rank, values ``[v, 0]`` from initial state
  ``[0, I]``, gives all of it for all its slots: outputs ``[o^0, scale P^T q]`` and final states ``[S^0, P]``
  (``B`` and ``A`` below). One all_gather exchanges the final states (``2 x (K + V) x K`` numbers per head and
  sequence from each rank, whatever the sequence's length); every rank chains its sequences' 2cp slots to the
  states ``S_in`` its own slots start from and adds each token's ``(scale P_t^T q_t)^T S_in`` (a ``[K] x [K, V]``
  product per token and head, fp32): no second run of the rule.

Gradients go through autograd: the rule's (through its initial and final states), the chain's matmuls, and the
gathers, whose backward sums the gradient every rank has for each slot (one all_reduce). ``rule`` is any delta
rule with initial and final states over a varlen pack (fla's ``chunk_gated_delta_rule`` as ``kernels.Core`` calls it,
or the release's torch rule one slot at a time, ``per_slot``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

# rule(q, k, v, g, beta, initial_state [P, H, K, V], cu [P + 1]) -> (o [1, T, H, V], final state [P, H, K, V])
Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Slots:
    """This rank's share of a pack in megatron's load-balanced THD CP layout.

    ``lengths``: every sequence's (padded) length in the whole pack, zero-length entries included. The rank's
    tokens are its pieces: for every non-empty sequence its front slot (``rank``) then its back slot
    (``2cp-1-rank``), ``length / (2 cp)`` tokens each; piece ``2j + part`` is sequence j's front (0) or back (1)."""

    cp: int
    rank: int
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, lengths: Sequence[int], cp: int, rank: int) -> Slots:
        if cp < 1 or not 0 <= rank < cp:
            raise ValueError(f"gdn_compat CP state passing: rank {rank} of context parallel size {cp}")
        for i, n in enumerate(lengths):
            if n < 0 or n % (2 * cp):
                raise ValueError(f"gdn_compat CP state passing: sequence {i} of the pack has (padded) length {n}; "
                                 f"with context parallel size {cp} every length must be a multiple of 2 x cp = "
                                 f"{2 * cp} (megatron's THD CP layout, cu_seqlens_q_padded)")
        return cls(cp, rank, tuple(int(n) for n in lengths))

    @property
    def halves(self) -> tuple[int, ...]:
        """Each non-empty sequence's slot length."""
        return tuple(n // (2 * self.cp) for n in self.lengths if n)

    @property
    def cu(self) -> list[int]:
        """Boundaries of this rank's pieces in its local tokens."""
        cu = [0]
        for h in self.halves:
            cu += [cu[-1] + h, cu[-1] + 2 * h]
        return cu

    def order(self) -> list[tuple[int, int]]:
        """(rank, part) of slots 0 .. 2cp-1: the ranks a sequence's state visits."""
        cp = self.cp
        return [(c, 0) if c < cp else (2 * cp - 1 - c, 1) for c in range(2 * cp)]


class _Gather(torch.autograd.Function):
    """all_gather along a new first dim; backward: the sum over ranks of the gradient for this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[cp, *x.shape]``, every rank's ``x``, differentiable."""
    return _Gather.apply(x, group)


def halo(x: torch.Tensor, slots: Slots, width: int, group: Any) -> torch.Tensor:
    """``[P, width - 1, C]``: the ``width - 1`` tokens of its sequence before each of this rank's pieces (zeros
    before a sequence's start); ``x`` ``[T_local, C]`` is the conv's input."""
    keep = width - 1
    pieces, channels = len(slots.cu) - 1, x.shape[-1]
    if keep == 0 or pieces == 0:
        return x.new_zeros(pieces, keep, channels)
    index, tail_mask, shift = _halo_layout(slots, keep, x.device)
    # each piece's last min(keep, h) tokens, right-aligned in keep rows
    tails = x[index].reshape(pieces, keep, channels) * tail_mask.to(x.dtype)
    every = gather(tails, group)  # [cp, P, keep, C]
    shift = shift[..., None].expand(-1, -1, channels)  # [N, keep, C] into cat([history, tail])
    history = x.new_zeros(pieces // 2, keep, channels)
    mine: list[torch.Tensor | None] = [None, None]
    for rank, part in slots.order():
        if rank == slots.rank:
            mine[part] = history
        if part == 1 and rank == slots.rank:  # this rank's back slot is its last: nothing after it is needed
            break
        history = torch.gather(torch.cat([history, every[rank, part::2]], dim=1), 1, shift)
    assert mine[0] is not None and mine[1] is not None
    return torch.stack([mine[0], mine[1]], dim=1).reshape(pieces, keep, channels)


@lru_cache(maxsize=64)
def _halo_layout(slots: Slots, keep: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index tensors for ``halo``, on ``device`` once per layout (as ``_carry_layout``): the rows of each piece's
    last ``keep`` tokens ``[P * keep]``, which of them are the piece's own ``[P, keep, 1]`` (a piece shorter than
    ``keep`` gives fewer), and per sequence where each history row comes from in ``cat([history, tail])``
    ``[N, keep]``."""
    rows = torch.arange(keep)
    valid = torch.tensor([min(keep, h) for h in slots.halves for _ in (0, 1)])
    ends = torch.tensor(slots.cu[1:])
    index = (ends[:, None] - keep + rows[None, :]).clamp_min(0).reshape(-1)
    tail_mask = (rows[None, :] >= keep - valid[:, None])[..., None]
    m = valid[0::2]  # per sequence: the rows a slot adds to the history
    shift = torch.where(rows[None, :] < keep - m[:, None], rows[None, :] + m[:, None], keep + rows[None, :])
    return index.to(device), tail_mask.to(device), shift.to(device)


def conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slots: Slots, group: Any) -> torch.Tensor:
    """The causal depthwise conv (before its activation) of this rank's pieces, each continuing its sequence:
    ``x`` ``[T_local, C]``, ``weight`` ``[C, 1, W]`` (nn.Conv1d's) -> ``[T_local, C]``."""
    width = weight.shape[-1]
    cu = slots.cu
    past = halo(x, slots, width, group)  # [P, W-1, C]
    parts = []
    for p, (a, b) in enumerate(zip(cu, cu[1:])):
        parts += [past[p], x[a:b]]
    if not parts:
        return x[:0]
    ext = torch.cat(parts).t()[None]  # [1, C, T_local + P (W-1)]
    out = F.conv1d(ext, weight, bias, groups=weight.shape[0])[0].t()  # each output sees only its own piece's rows
    return out[_conv_rows(slots, width, out.device)]


@lru_cache(maxsize=64)
def _conv_rows(slots: Slots, width: int, device: torch.device) -> torch.Tensor:
    """The rows of ``conv``'s output that are its pieces' own tokens (each piece follows its ``width - 1`` halo
    rows), on ``device`` once per layout."""
    cu = slots.cu
    return torch.cat([torch.arange(a + p * (width - 1), b + p * (width - 1))
                      for p, (a, b) in enumerate(zip(cu, cu[1:]))]).to(device)


def start_states(A: torch.Tensor, B: torch.Tensor, slots: Slots) -> torch.Tensor:
    """The state each of this rank's pieces starts from, ``[P, H, K, V]``: every rank's ``A`` ``[cp, P, H, K, K]``
    and ``B`` ``[cp, P, H, K, V]`` chained over the 2cp slots of each sequence, from zero."""
    state = B.new_zeros(B.shape[1] // 2, *B.shape[2:])
    mine: list[torch.Tensor | None] = [None, None]
    for rank, part in slots.order():
        if rank == slots.rank:
            mine[part] = state
            if part == 1:
                break
        state = A[rank, part::2] @ state + B[rank, part::2]
    assert mine[0] is not None and mine[1] is not None
    return torch.stack([mine[0], mine[1]], dim=1).reshape(B.shape[1:])


def end_grads(A: torch.Tensor, D: torch.Tensor, slots: Slots) -> torch.Tensor:
    """The gradient each of this rank's pieces gets at its final state, ``[P, H, K, V]``: the loss's gradient at the
    start state of the slot after it in its sequence (zero after a sequence's last slot). ``A`` ``[cp, P, H, K, K]``
    are every rank's slot transitions and ``D`` ``[cp, P, H, K, V]`` the gradient each slot's outputs alone give its
    start state; a slot's start-state gradient is ``D + A^T`` (its final-state gradient), chained back from the
    last slot (the adjoint of ``start_states``)."""
    grad = D.new_zeros(D.shape[1] // 2, *D.shape[2:])
    mine: list[torch.Tensor | None] = [None, None]
    for rank, part in reversed(slots.order()):
        if rank == slots.rank:
            mine[part] = grad
            if part == 0:
                break
        grad = A[rank, part::2].transpose(-1, -2) @ grad + D[rank, part::2]
    assert mine[0] is not None and mine[1] is not None
    return torch.stack([mine[0], mine[1]], dim=1).reshape(D.shape[1:])


def delta_rule(rule: Rule, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               slots: Slots, group: Any) -> torch.Tensor:
    """The gated delta rule over whole sequences of which this rank holds ``slots``: ``q``/``k`` ``[1, T, H, K]``
    (repeated to v's heads), ``v`` ``[1, T, H, V]``, ``g``/``beta`` ``[1, T, H]`` -> ``o`` ``[1, T, H, V]``."""
    if len(slots.cu) == 1:
        return v * 0
    wide, final = local_pass(rule, q, k, v, g, beta, slots)
    return corrected(wide, gather(final, group), slots)


def local_pass(rule: Rule, q, k, v, g, beta, slots: Slots) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over this rank's pieces from ``[0, I]`` with values ``[v, 0]``: outputs ``[1, T, H, V + K]``
    (``[o^0, scale P^T q]``) and final states ``[P, H, K, V + K]`` (each piece's ``[B, A]``)."""
    pieces, heads, dk, dv = len(slots.cu) - 1, v.shape[2], k.shape[-1], v.shape[-1]
    eye = torch.eye(dk, device=v.device, dtype=torch.float32).expand(pieces, heads, dk, dk)
    start = torch.cat([eye.new_zeros(pieces, heads, dk, dv), eye], dim=-1)
    return rule(q, k, torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], dim=-1), g, beta, start, slots.cu)


def corrected(wide: torch.Tensor, every: torch.Tensor, slots: Slots) -> torch.Tensor:
    """This rank's output ``[1, T, H, V]`` (``wide``'s dtype): its ``local_pass`` outputs ``wide``, each token's
    ``o^0`` plus its ``(scale P^T q)^T S_in``, the start states chained from ``every`` rank's final states
    ``[cp, P, H, K, V + K]``."""
    dk = every.shape[-2]
    B, A = every.split([every.shape[-1] - dk, dk], dim=-1)
    zero, carry = wide.split([every.shape[-1] - dk, dk], dim=-1)
    exact = torch.promote_types(wide.dtype, torch.float32)
    start = start_states(A, B, slots).to(exact)
    return (zero.to(exact) + carried(carry[0].to(exact), start, slots)[None]).to(wide.dtype)


def carried(carry: torch.Tensor, start: torch.Tensor, slots: Slots) -> torch.Tensor:
    """``[T, H, V]``: every token's ``carry`` ``[T, H, K]`` times the start state ``[H, K, V]`` of its piece
    (``start`` ``[P, H, K, V]``), as a few batched products over pieces of similar lengths."""
    groups, inverse = _carry_layout(slots, carry.device)
    rows = [torch.einsum("plhk,phkv->plhv", carry[index], start[pieces]).flatten(0, 1) for pieces, index in groups]
    return (rows[0] if len(rows) == 1 else torch.cat(rows))[inverse]


@lru_cache(maxsize=64)
def _carry_layout(slots: Slots, device: torch.device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Index tensors for ``carried``, on ``device`` once per layout (every layer and recompute of a step share them:
    no copy from the host per call): the pieces in groups whose lengths are within a factor of two of the
    group's longest (so padding at most doubles a group's rows), each group's ``[G, L]`` token index (a short piece's
    padding repeats its last token), and where each token's row lands in the groups' rows laid end to end."""
    cu = slots.cu
    n = [b - a for a, b in zip(cu, cu[1:])]
    grouped: list[list[int]] = []
    for p in sorted(range(len(n)), key=lambda p: -n[p]):
        if grouped and n[grouped[-1][0]] <= 2 * n[p]:
            grouped[-1].append(p)
        else:
            grouped.append([p])
    inverse = torch.empty(cu[-1], dtype=torch.long)
    groups, offset = [], 0
    for pieces in grouped:
        width = n[pieces[0]]
        first, lengths = torch.tensor([cu[p] for p in pieces]), torch.tensor([n[p] for p in pieces])
        steps = torch.arange(width)
        index = first[:, None] + torch.minimum(steps[None, :], lengths[:, None] - 1)
        real = steps[None, :] < lengths[:, None]
        inverse[index[real]] = offset + torch.arange(len(pieces) * width).reshape(len(pieces), width)[real]
        groups.append((torch.tensor(pieces).to(device), index.to(device)))
        offset += len(pieces) * width
    return groups, inverse.to(device)


def per_slot(release_rule: Callable[..., Any]) -> Rule:
    """``rule`` from a torch rule of one batch of sequences (the release's ``torch_chunk_gated_delta_rule``):
    one piece at a time, each from its initial state."""

    def rule(q, k, v, g, beta, initial_state, cu):
        outs, finals = [], []
        for p, (a, b) in enumerate(zip(cu, cu[1:])):
            o, s = release_rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                                initial_state=None if initial_state is None else initial_state[p:p + 1],
                                output_final_state=True,
                                use_qk_l2norm_in_kernel=False)
            outs.append(o)
            finals.append(s)
        return torch.cat(outs, dim=1), torch.cat(finals)

    return rule
