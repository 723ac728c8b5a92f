"""mtp_packed_roll (#13 part 2) through the release's real ``roll_tensor``: cp = 1 in this process,
cp = 2 and cp = 4 over gloo with Megatron's load-balanced layout.

Token values carry their sequence: real token k of sequence i holds ``100 * (i + 1) + k``, padding
holds -1, the loss mask is 1 on real tokens. The reference is independent of both implementations:
per sequence, on the whole pack, ``out[p] = x[p + 1]`` for the real tokens but the last, else 0.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

import gdn_compat
from tests.support.gdn import offsets, packed, shard
from tests.support.release import skip_reason

pytestmark = pytest.mark.skipif(skip_reason("mtp_packed_roll") is not None,
                                reason=str(skip_reason("mtp_packed_roll")))

# (real lengths, padded slots); slots divide by 2 x cp for cp = 2 and 4; a length-1 sequence, a full slot
PADDED = ([5, 1, 16, 2], [8, 8, 16, 8])
UNPADDED = [1, 7, 16, 3, 9]
UNPADDED_CP = [8, 24, 16, 8]  # unpadded, each divisible by 2 x cp = 4 and 8


def tokens(lengths: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, T] ids carrying their sequence, and the [1, T] loss mask."""
    ids, mask = torch.full((sum(slots),), -1, dtype=torch.long), torch.zeros(sum(slots))
    for i, (start, n) in enumerate(zip(offsets(slots), lengths)):
        ids[start:start + n] = 100 * (i + 1) + torch.arange(n)
        mask[start:start + n] = 1
    return ids[None], mask[None]


def reference(x: torch.Tensor, lengths: list[int], slots: list[int]) -> torch.Tensor:
    out = torch.zeros_like(x)
    for start, n in zip(offsets(slots), lengths):
        out[..., start:start + n - 1] = x[..., start + 1:start + n]
    return out


def strays(ids: torch.Tensor, mask: torch.Tensor, lengths: list[int], slots: list[int]) -> list[tuple[int, int]]:
    """(position, value) wherever the rolled mask is set but the rolled id is not of that position's sequence."""
    owner = torch.cat([torch.full((s,), i + 1) for i, s in enumerate(slots)])
    bad = (mask[0] != 0) & (ids[0] // 100 != owner)
    return [(p, int(ids[0, p])) for p in bad.nonzero().flatten().tolist()]


def roll(x, psp, group=None):
    from megatron.core.transformer import multi_token_prediction as mtp

    return mtp.roll_tensor(x, shifts=-1, dims=-1, cp_group=group, packed_seq_params=psp)


def padded_psp():
    lengths, slots = PADDED
    return packed(offsets(lengths), offsets(slots))


def test_release_roll_takes_mtp_labels_from_the_neighbouring_sequence_of_a_padded_pack():
    ids, mask = tokens(*PADDED)
    rolled_ids, _ = roll(ids, padded_psp())
    rolled_mask, _ = roll(mask, padded_psp())
    assert strays(rolled_ids, rolled_mask, *PADDED), "the release rolled a padded pack correctly: drop the patch"


def test_patched_roll_of_a_padded_pack_keeps_every_target_in_its_sequence():
    ids, mask = tokens(*PADDED)
    with gdn_compat.applied() as report:
        assert report["mtp_packed_roll"].status == "applied"
        rolled_ids, _ = roll(ids, padded_psp())
        rolled_mask, num_tokens = roll(mask, padded_psp())
        rolled_bool, _ = roll(mask.bool(), padded_psp())  # 0.18+ roll the bool padding mask too
    assert strays(rolled_ids, rolled_mask, *PADDED) == []
    assert torch.equal(rolled_ids, reference(ids, *PADDED))
    assert torch.equal(rolled_mask, reference(mask, *PADDED))
    assert torch.equal(rolled_bool, reference(mask.bool(), *PADDED))
    assert num_tokens.item() == sum(n - 1 for n in PADDED[0])  # one MTP target fewer per sequence


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_unpadded_pack_at_cp1_is_bitwise_the_release_roll(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, sum(UNPADDED), generator=gen) * 50).to(dtype)  # leading dims are kept as the release
    psp = packed(offsets(UNPADDED))
    want, want_sum = roll(x, psp)
    with gdn_compat.applied():
        got, got_sum = roll(x, psp)
    assert got.dtype == want.dtype and torch.equal(got, want) and torch.equal(got_sum, want_sum)


def test_return_sum_false_skips_the_sum_as_main_asks():
    """megatron main (0.20) added ``return_sum=True`` to the roll; the patched roll takes it on every release."""
    from megatron.core.transformer import multi_token_prediction as mtp

    ids, _ = tokens(*PADDED)
    with gdn_compat.applied():
        rolled, total = mtp._roll_tensor_packed_seq(ids, -1, -1, padded_psp(), None, return_sum=False)
        _, with_sum = mtp._roll_tensor_packed_seq(ids, -1, -1, padded_psp(), None)
    assert total is None and torch.equal(rolled, reference(ids, *PADDED)) and with_sum == rolled.sum()


def test_patched_roll_refuses_what_the_release_asserts_with_the_values():
    from megatron.core.transformer import multi_token_prediction as mtp

    with gdn_compat.applied(), pytest.raises(ValueError, match="shifts=-2, dims=-1"):
        mtp.roll_tensor(torch.zeros(1, 8), shifts=-2, dims=-1, packed_seq_params=padded_psp())


def test_patched_roll_rejects_offsets_that_do_not_cover_the_tensor():
    with gdn_compat.applied(), pytest.raises(ValueError, match=r"cu_seqlens_q_padded\[-1\]=40 .* 41"):
        roll(torch.zeros(1, 41), padded_psp())


def test_revert_restores_the_release_roll():
    from megatron.core.transformer import multi_token_prediction as mtp

    release = mtp._roll_tensor_packed_seq
    with gdn_compat.applied():
        assert mtp._roll_tensor_packed_seq is not release
    assert mtp._roll_tensor_packed_seq is release


def _cases(cp: int, rank: int, group) -> dict:
    """This rank's findings for one cp group: patched vs the reference shard, and the release."""
    out = {}
    for name, (lengths, slots) in {"padded": PADDED, "unpadded": (UNPADDED_CP, UNPADDED_CP)}.items():
        ids, mask = tokens(lengths, slots)
        local = [shard(t[0], slots, cp, rank)[None] for t in (ids, mask)]
        psp = packed(offsets(lengths), offsets(slots) if name == "padded" else None)
        # the release's CP roll runs on unpadded packs only: on a padded pack its ranks disagree about
        # chunk sizes and its point-to-point exchanges leave the gloo group unusable (measured: the
        # next collective times out), so there the hole is shown at cp = 1 only
        release = {key: roll(t, psp, group)[0] for key, t in zip(("ids", "mask"), local)} if name == "unpadded" else {}
        with gdn_compat.applied():
            got = {key: roll(t, psp, group) for key, t in zip(("ids", "mask", "bool"), [*local, local[1].bool()])}
        want = {"ids": reference(ids, lengths, slots), "mask": reference(mask, lengths, slots)}
        want["bool"] = want["mask"].bool()
        want = {k: shard(v[0], slots, cp, rank)[None] for k, v in want.items()}
        owner = shard(torch.cat([torch.full((s,), i + 1) for i, s in enumerate(slots)]), slots, cp, rank)
        stray = ((got["mask"][0] != 0) & (got["ids"][0][0] // 100 != owner)).sum().item()
        result = {"equal": {k: torch.equal(got[k][0], want[k]) for k in got},
                  "sum": [got["mask"][1].item(), want["mask"].sum().item()], "strays": stray}
        if release:
            result["release_equal"] = all(torch.equal(release[k], want[k]) for k in release)
        out[name] = result
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pair = dist.new_group([0, 1])  # every rank takes part in creating it
        found = {"cp4": _cases(4, rank, dist.group.WORLD)}
        if rank < 2:
            found["cp2"] = _cases(2, rank, pair)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(found, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
        from tests.support import suite_records

        suite_records.log_imports()  # this rank's imports count for the heavy-suite records


@pytest.fixture(scope="module")
def cp_findings():
    from tests.support.megatron import free_port, spawn

    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, (4, free_port(), tmp), 4)
        return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(4)]


def _cells(findings, cp: int, pack: str) -> list[dict]:
    return [f[f"cp{cp}"][pack] for f in findings if f"cp{cp}" in f]


@pytest.mark.heavy
@pytest.mark.parametrize("cp", [2, 4])
def test_patched_roll_under_context_parallelism_matches_the_whole_pack_reference(cp_findings, cp):
    for rank, cell in enumerate(_cells(cp_findings, cp, "padded")):
        assert cell["strays"] == 0 and all(cell["equal"].values()), f"cp{cp} rank {rank}: {cell}"
        assert cell["sum"][0] == cell["sum"][1], f"cp{cp} rank {rank}: local MTP target count {cell['sum']}"


@pytest.mark.heavy
@pytest.mark.parametrize("cp", [2, 4])
def test_unpadded_pack_under_context_parallelism_equals_the_release(cp_findings, cp):
    for rank, cell in enumerate(_cells(cp_findings, cp, "unpadded")):
        assert all(cell["equal"].values()), f"cp{cp} rank {rank}: {cell}"
        assert cell.get("release_equal") is True, f"cp{cp} rank {rank}: the release disagrees: {cell}"
