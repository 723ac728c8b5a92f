"""mtp_packed_roll: the MTP roll of a packed micro-batch respects padded slots and context parallelism.

MTP shifts ids, positions, labels and the loss mask one token left within every sequence
(``roll_tensor`` -> ``_roll_tensor_packed_seq`` in ``multi_token_prediction``). Every release with it
(0.16.x-0.19.2) slices by ``cu_seqlens_q`` even when the tokens are laid out by
``cu_seqlens_q_padded`` (alignment padding; always so under context parallelism), so in a padded
pack the MTP labels, loss mask and inputs are taken from the neighbouring sequence or from padding:
a silently wrong MTP loss. Upstream fixed it on its dev branch only (PR #4494; #4495 and #6205 are
open on main). The release's function also indexes a device tensor per sequence in a Python loop
(host syncs per boundary) and, under cp > 1, runs two point-to-point exchanges per sequence.

The replacement rolls by the pack's layout (padded slots when given): position p of a sequence gets
p + 1 of the same sequence while p + 1 is one of its real tokens; the last real token and every
padding slot get 0. Under context parallelism (Megatron's load balancing: rank r holds chunks r and
2*cp-1-r of every sequence) the rank's shard is all-gathered once and rolled by a precomputed index.
The index is derived once per pack from gdn_thd's pack cache (one host copy per pack, shared with
the GDN layers of the micro-batch); a roll itself makes no host sync. Under CUDA-graph capture (or
for a ``gdn_compat.graphs.PackBuffer``) gdn_thd hands over a device pack and the index is built with
device ops from the offsets, so a captured MTP step replays any layout. For unpadded packs at cp = 1
the result is bitwise the release's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from gdn_compat._probe import MTP_MODULE, Facts, Roll
from gdn_compat._registry import Patch, Target
from gdn_compat.patches.gdn_thd.pack import Pack, pack_for, to_device


def decide(facts: Facts) -> str | None:
    mc = facts.release
    if facts.mtp_roll is Roll.ABSENT:
        return f"{mc} has no packed MTP roll (multi_token_prediction._roll_tensor_packed_seq)"
    if facts.mtp_roll is Roll.PADDED:
        return f"{mc} _roll_tensor_packed_seq already rolls by cu_seqlens_q_padded (upstream PR #4494)"
    if facts.mtp_roll is not Roll.UNPADDED:
        return f"not patched, unknown MTP roll: {facts.notes.get('mtp_roll', facts.mtp_roll)}"
    return None


def roll_index(pack: Pack, cp: int, rank: int, local: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, keep) on ``device``: rolled[j] = source[index[j]] where keep[j], else 0. ``source`` is
    the local tensor at cp = 1, else the cp ranks' shards concatenated in rank order (the order
    ``pack.perm`` indexes: gdn_thd's load-balancing permutation, reused, not rebuilt)."""
    if pack.real_ends is not None:  # a graph-safe device pack (cp = 1): the same rule, with device ops only
        position = torch.arange(local, device=device)
        seq = torch.searchsorted(pack.cu[1:].to(torch.int64), position, right=True)
        keep = position + 1 < pack.real_ends[seq.clamp_(max=pack.real_ends.numel() - 1)]
        return (position + 1).clamp_(max=max(local - 1, 0)), keep
    total = local * cp
    keep = torch.zeros(total, dtype=torch.bool)
    for (start, _), end in zip(pack.spans, pack.ends):
        keep[start:max(start, end - 1)] = True  # the next token is a real one of the same sequence
    following = torch.arange(1, total + 1).clamp_(max=total - 1)
    keep, following = to_device(keep, device), to_device(following, device)
    if pack.perm is None or pack.inverse is None:
        return following, keep
    mine = pack.inverse[rank * local:(rank + 1) * local]  # global position of each local token
    return pack.perm[following[mine]], keep[mine]  # device indexing: no host sync


def _gather(tensor: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """The cp ranks' shards of ``tensor`` concatenated along the last dim, in rank order."""
    flat = tensor.contiguous()
    as_bytes = flat.dtype == torch.bool  # gloo has no bool collectives
    if as_bytes:
        flat = flat.view(torch.uint8)
    parts = [torch.empty_like(flat) for _ in range(cp)]
    dist.all_gather(parts, flat, group=group)
    out = torch.cat(parts, dim=-1)
    return out.view(torch.bool) if as_bytes else out


def build(facts: Facts, original: Any) -> Any:
    @functools.wraps(original)
    def _roll_tensor_packed_seq(tensor, shifts, dims, packed_seq_params, cp_group=None, return_sum=True):
        # return_sum: megatron main's keyword (the sum is skipped when the caller does not need it); the
        # releases 0.16-0.19 never pass it and always get the sum, as before
        if shifts != -1 or dims not in (-1, tensor.dim() - 1):
            raise ValueError(f"gdn_compat mtp_packed_roll: a packed roll shifts the last dim by -1 (as the "
                             f"release's); got shifts={shifts}, dims={dims} for a {tensor.dim()}-d tensor")
        cp = cp_group.size() if cp_group is not None else 1
        if cp > 1 and tensor.requires_grad:
            raise ValueError("gdn_compat mtp_packed_roll: rolling a tensor that requires grad under context "
                             "parallelism is not supported (megatron-core rolls ids, positions, labels, masks)")
        local = tensor.shape[-1]
        if local == 0:
            rolled = tensor.clone()
            return rolled, rolled.sum() if return_sum else None
        pack = pack_for(packed_seq_params, local * cp, tensor.device, cp)
        rank = dist.get_rank(group=cp_group) if cp > 1 else 0
        key = ("mtp_roll", rank)  # the pack itself is keyed by tokens, device and cp
        if key not in pack.memo:
            pack.memo[key] = roll_index(pack, cp, rank, local, tensor.device)
        index, keep = pack.memo[key]
        source = tensor if cp == 1 else _gather(tensor, cp_group, cp)
        rolled = torch.where(keep, source.index_select(-1, index), tensor.new_zeros(()))
        return rolled, rolled.sum() if return_sum else None

    return _roll_tensor_packed_seq


PATCH = Patch(
    name="mtp_packed_roll",
    target=Target(MTP_MODULE, "", "_roll_tensor_packed_seq"),
    decide=decide,
    build=build,
    summary="the MTP roll of a packed micro-batch shifts within each sequence's real tokens by the padded "
            "layout (cu_seqlens_q_padded) and under context parallelism, with no host sync per sequence "
            "(upstream dev PR #4494; open on main: #4495, #6205)",
)
