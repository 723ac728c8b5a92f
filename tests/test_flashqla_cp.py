"""gdn_flashqla's use of FlashQLA's intra-card context parallelism (#37), on the CPU.

FlashQLA's kernels and its cost model need an sm90/sm100 GPU (tests/gpu/test_shapes_gpu.py runs one 64k document
through them against an fp32 truth). Here a stand-in ``build_cp_context`` of FlashQLA's contract (flash-qla 0.1.3,
``flash_qla/ops/gated_delta_rule/chunk/cp/context.py``: sequences longer than a segment are cut into segments of
``max_local_chunks`` chunks; ``seq_map_c2r`` maps a segment to its sequence, ``seq_map_r2c`` a sequence to its first
segment) checks what gdn_compat decides with and hands on: the decision from the host offsets, once per pack and
head count; no context where FlashQLA would not split or has no CP; one context for forward and backward; nothing
for a graph-safe pack.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from gdn_compat.patches.gdn_thd import fast
from gdn_compat.patches.gdn_thd import pack as P
from tests.support.fused import CU, DIMS, FakeFlashQla, gradients, interpreted_or_cuda, region_inputs, token_bounds
from tests.support.gdn import offsets, packed

SEGMENT = 4  # chunks of 64 per segment in the stand-in's split


@dataclasses.dataclass
class Context:  # the fields of FlashQLA's FlashQLACPContext that intra-card CP uses
    is_inter: bool = False
    is_intra: bool = False
    cu_seqlens: torch.Tensor | None = None
    intra_cp_cu_seqlens: torch.Tensor | None = None
    seq_map_r2c: torch.Tensor | None = None
    seq_map_c2r: torch.Tensor | None = None
    ht_mask: torch.Tensor | None = None
    ht_mask_bwd: torch.Tensor | None = None


@pytest.fixture
def flashqla_cp(monkeypatch):
    """A ``flash_qla`` package holding only ``...chunk.cp.build_cp_context``: it records its calls and splits every
    sequence of more than SEGMENT chunks (its cost model's call, here a fixed rule)."""
    calls = []

    def build_cp_context(cu, *, enable_intra, num_v_heads, chunk_size, is_train):
        calls.append({"device": cu.device.type, "dtype": cu.dtype, "offsets": cu.tolist(), "heads": num_v_heads,
                      "enable_intra": enable_intra, "chunk_size": chunk_size, "is_train": is_train})
        bounds = cu.tolist()
        if all(b - a <= SEGMENT * chunk_size for a, b in zip(bounds, bounds[1:])):
            return Context(cu_seqlens=cu)
        starts, c2r, r2c, mask, mask_bwd = [], [], [0], [], []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            cut = list(range(a, b, SEGMENT * chunk_size))
            starts += cut
            c2r += [i] * len(cut)
            mask += [False] * (len(cut) - 1) + [True]
            mask_bwd += [True] + [False] * (len(cut) - 1)
            r2c.append(len(starts))
        return Context(is_intra=True, cu_seqlens=cu, intra_cp_cu_seqlens=torch.tensor(starts + [bounds[-1]]),
                       seq_map_r2c=torch.tensor(r2c), seq_map_c2r=torch.tensor(c2r), ht_mask=torch.tensor(mask),
                       ht_mask_bwd=torch.tensor(mask_bwd))

    names = ["flash_qla", "flash_qla.ops", "flash_qla.ops.gated_delta_rule", "flash_qla.ops.gated_delta_rule.chunk",
             "flash_qla.ops.gated_delta_rule.chunk.cp"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].build_cp_context = build_cp_context
    return calls


def _host_pack(lengths):
    return P.pack_for(packed(offsets(lengths)), sum(lengths), torch.device("cpu"))


def test_intra_card_cp_is_decided_from_the_host_offsets_once_per_pack(flashqla_cp):
    lengths = [300, 0, 2000, 0, 0, 64, 1]  # empty entries: the decision sees the pack's real sequences only
    pack = _host_pack(lengths)
    context = fast.flashqla_context(pack, 32)
    assert fast.flashqla_context(pack, 32) is context  # every layer of the step: the same context, decided once
    real = offsets([n for n in lengths if n])
    assert flashqla_cp == [{"device": "cpu", "dtype": torch.int64, "offsets": real, "heads": 32,
                            "enable_intra": True, "chunk_size": 64, "is_train": True}]
    fast.flashqla_context(pack, 16)  # another local head count (another layer shape or tp): decided again
    assert [c["heads"] for c in flashqla_cp] == [32, 16]
    assert context.is_intra and context.cu_seqlens is fast.flashqla_cu(pack)  # FlashQLA's offsets, metadata on


def test_no_context_where_flashqla_would_not_split_so_it_is_called_as_before(flashqla_cp):
    pack = _host_pack([200, 64, 1])
    assert fast.flashqla_context(pack, 32) is None and fast.cp_context(pack, 32) == {}
    assert len(flashqla_cp) == 1


def test_a_graph_safe_pack_never_uses_intra_card_cp(flashqla_cp):
    """A captured step or a PackBuffer's offsets: the decision would read the offsets on the host, so none is made."""
    cu = torch.tensor(offsets([3000, 1]) + [3001] * 3, dtype=torch.int32)
    pack = P.device_pack({"cu_seqlens_q": cu, "cu_seqlens_kv": cu}, 3001, torch.device("cpu"), 1)
    assert fast.flashqla_context(pack, 32) is None and fast.cp_context(pack, 32) == {}
    assert flashqla_cp == []


def test_no_context_where_the_installed_flashqla_has_no_intra_card_cp(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_qla", types.ModuleType("flash_qla"))
    assert fast.flashqla_context(_host_pack([5000]), 32) is None


@pytest.mark.skipif(interpreted_or_cuda() is not None, reason=str(interpreted_or_cuda()))
@pytest.mark.interpreted_fused
def test_the_fused_region_hands_flashqla_one_context_for_forward_and_backward():
    """FlashQLA's forward and backward must agree on the split: the region's core gives both the same context."""
    from gdn_compat.fused.cores import FlashQlaCore
    from gdn_compat.fused.region import Spec, region

    fake, context = FakeFlashQla(), Context(is_intra=True)
    cu = torch.tensor(CU, dtype=torch.int64)
    spec = Spec(**DIMS, l2norm=True, norm_eps=1e-5, zero_centered=False,
                core=FlashQlaCore(fake, cu, {"cp_context": context}))
    x, params = region_inputs()
    gradients(lambda *a: region(*a, token_bounds(CU, x.shape[0]), spec), x, params)
    assert [c["pass"] for c in fake.calls] == ["fwd", "bwd"]
    assert all(c["cp_context"] is context for c in fake.calls)
