"""Context parallelism for the patched GatedDeltaNet (megatron-core 0.16/0.17 have none).

The same design as upstream 0.18/0.19 (PR #2645, and #4913's single all-to-all for a whole pack),
written here: after the input projection, one all-to-all turns "my tokens, all heads" into "all
tokens, my heads" (context parallel -> head parallel) and a permutation undoes Megatron's load
balancing (rank r holds chunks r and 2*cp-1-r of every sequence); the conv and the delta rule then
see whole sequences; the reverse permutation and all-to-all run before the output projection.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (equal splits); it is its own transpose, so backward is one too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()  # empty_like keeps a view's strides; the collective writes raw memory
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        # through the Function again, so a gradient of this gradient (create_graph=True) is exchanged too
        return _AllToAll.apply(grad, ctx.group), None


def load_balance_perm(lengths: list[int], cp: int) -> torch.Tensor:
    """perm[g] = index into the received ``[cp * local_tokens]`` rows of global pack position g.

    Each sequence of length L is cut into 2*cp chunks of L/(2*cp); rank i holds chunks i and
    2*cp-1-i of every sequence, back to back, sequences in order (Megatron's THD/BSHD layout)."""
    local = sum(lengths) // cp
    perm = torch.empty(sum(lengths), dtype=torch.long)
    start = local_start = 0
    for length in lengths:
        half = length // (2 * cp)
        for c in range(2 * cp):
            rank, second = (c, 0) if c < cp else (2 * cp - 1 - c, 1)
            src = rank * local + local_start + second * half
            perm[start + c * half: start + (c + 1) * half] = torch.arange(src, src + half)
        start += length
        local_start += length // cp
    return perm


def cp2hp(x: torch.Tensor, sections: list[int], perm: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[local tokens, b, sum(sections)] -> [all tokens, b, sum(sections) / cp], global token order.

    Every section (q, k, v, z, beta, alpha) is split into cp head groups; rank j receives group j."""
    t, b = x.shape[0], x.shape[1]
    parts = [p.reshape(t, b, cp, -1) for p in torch.split(x, sections, dim=-1)]
    send = torch.cat(parts, dim=-1).permute(2, 0, 1, 3)  # [cp, t, b, F/cp]
    recv = _AllToAll.apply(send, group)
    return recv.reshape(cp * t, b, -1).index_select(0, perm)


def hp2cp(y: torch.Tensor, inverse: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[all tokens, b, f] (my heads) -> [local tokens, b, f * cp] (all heads), Megatron's order."""
    total, b = y.shape[0], y.shape[1]
    send = y.index_select(0, inverse).reshape(cp, total // cp, b, -1)
    recv = _AllToAll.apply(send, group)  # [cp (head group), local tokens, b, f]
    return recv.permute(1, 2, 0, 3).reshape(total // cp, b, -1)


def local_heads(param: torch.Tensor, sections: list[int], cp: int, rank: int) -> torch.Tensor:
    """This rank's head group of every section of a parameter's first dim."""
    return torch.cat([p.chunk(cp, dim=0)[rank] for p in torch.split(param, sections, dim=0)], dim=0)


def group_of(layer) -> Any:
    """The layer's context-parallel group (None when it has none)."""
    return getattr(getattr(layer, "pg_collection", None), "cp", None)


def size_of(layer) -> int:
    group = group_of(layer)
    return group.size() if group is not None else 1


def heads_divide(layer, cp: int) -> bool:
    """Whether the layer's key and value heads split evenly across tp x cp ranks (what the head all-to-all needs)."""
    tp = layer.tp_size
    return not (layer.num_key_heads % (tp * cp) or layer.num_value_heads % (tp * cp))
