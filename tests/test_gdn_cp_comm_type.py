"""gdn_cp_comm_type on the release's real GatedDeltaNet and TransformerLayer (0.16.x-0.18.x)."""

from __future__ import annotations

import inspect

import pytest
import torch

import gdn_compat
from tests.support.release import skip_reason

pytestmark = pytest.mark.skipif(skip_reason("gdn_cp_comm_type") is not None,
                                reason=str(skip_reason("gdn_cp_comm_type")))


def gdn(seed=0, **extra):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            linear_num_key_heads=2, linear_num_value_heads=4, normalization="RMSNorm")
    sub = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear)
    return GatedDeltaNet(cfg, sub, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
                         **extra)


def test_unpatched_release_rejects_cp_comm_type(megatron_cpu):
    with pytest.raises(TypeError, match="cp_comm_type"):
        gdn(cp_comm_type="p2p")


def test_patched_init_accepts_and_ignores_cp_comm_type(megatron_cpu):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    with gdn_compat.applied() as report:
        assert report["gdn_cp_comm_type"].status == "applied"
        assert "cp_comm_type" in inspect.signature(GatedDeltaNet.__init__).parameters
        for kind in ("p2p", "a2a", "allgather", "a2a+p2p", None):
            with_kw = gdn(cp_comm_type=kind)
            without = gdn()
            for (n, a), (_, b) in zip(with_kw.state_dict().items(), without.state_dict().items()):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (kind, n)
        with pytest.raises(TypeError, match="unexpected"):
            gdn(cp_comm_typo="p2p")  # only that one keyword is accepted
    with pytest.raises(TypeError, match="cp_comm_type"):
        gdn(cp_comm_type="p2p")
