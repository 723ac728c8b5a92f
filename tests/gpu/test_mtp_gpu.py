"""MTP with full recompute on an H200: 0.18.x patched, 0.19.x unpatched as the reference that the
test itself is valid; a 2-layer, 256-hidden GPTModel whose MTP layer is MoE, with real padding."""

from __future__ import annotations

import inspect

import pytest
import torch

import gdn_compat
from tests.support.mtp import batch, build_gpt, loss_and_grads
from tests.support.release import MEGATRON


def test_full_recompute_matches_no_recompute_with_padding_mask(megatron_cpu):
    from megatron.core.models.gpt import GPTModel

    if "padding_mask" not in inspect.signature(GPTModel.forward).parameters:
        pytest.skip(f"megatron-core {MEGATRON}: GPTModel.forward takes no padding_mask")
    plain = build_gpt(recompute=False, device="cuda", hidden=256)
    full = build_gpt(recompute=True, device="cuda", hidden=256)
    full.load_state_dict(plain.state_dict())
    data = batch(device="cuda")
    with gdn_compat.applied() as report:
        loss0, g0 = loss_and_grads(plain, data)
        loss0b, g0b = loss_and_grads(plain, data)  # run-to-run noise floor of this GPU stack
        loss1, g1 = loss_and_grads(full, data)
        _, g_unmasked = loss_and_grads(full, data, use_mask=False)
    noise = max((g0[n] - g0b[n]).abs().max().item() for n in g0)
    diff = max((g0[n] - g1[n]).abs().max().item() for n in g0)
    mask_effect = max((g0[n] - g_unmasked[n]).abs().max().item() for n in g0)
    bitwise = torch.equal(loss0, loss1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    print(f"\n[mtp {MEGATRON} {report['mtp_padding_mask'].status}] loss {loss0.item():.6f} vs recompute "
          f"{loss1.item():.6f}; bitwise={bitwise}; max grad diff {diff:.3g} (noise {noise:.3g}); "
          f"mask effect {mask_effect:.3g}")
    assert torch.equal(loss0, loss1)
    assert diff <= noise
    assert mask_effect > 100 * max(diff, 1e-9)


def test_mtp_roll_of_a_pack_makes_no_host_sync_once_the_pack_is_known(megatron_cpu):
    """Host syncs per MTP roll (labels of a 16-sequence pack on the GPU), the release's and patched."""
    from megatron.core.transformer import multi_token_prediction as mtp

    from tests.support.gdn import host_syncs, offsets, packed

    lengths = [256 + 48 * i for i in range(16)]
    psp = packed(offsets(lengths), [o + 8 * i for i, o in enumerate(offsets(lengths))])
    psp.cu_seqlens_q, psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda(), psp.cu_seqlens_kv.cuda()
    psp.cu_seqlens_q_padded = psp.cu_seqlens_kv_padded = psp.cu_seqlens_q_padded.cuda()
    labels = torch.arange(int(psp.cu_seqlens_q_padded[-1]), device="cuda")[None]

    def roll():
        mtp.roll_tensor(labels, shifts=-1, dims=-1, cp_group=None, packed_seq_params=psp)

    release = host_syncs(roll)
    with gdn_compat.applied():
        roll()  # the first roll of a pack: one host copy of its offsets
        patched = host_syncs(roll)
    print(f"\n[mtp-roll {MEGATRON}] host syncs per roll of a 16-sequence pack: release {len(release)}, "
          f"gdn_compat {len(patched)}")
    assert patched == [], patched[:3]
    assert len(release) >= len(lengths)  # the hole this patch closes: a sync per sequence boundary
