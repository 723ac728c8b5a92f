"""A training process that never imports gdn_compat: megatron-core 0.16/0.17's real GatedDeltaNet on the CPU, one
packed (THD) forward + backward. Run it as a file with ``python -P tests/support/auto_child.py`` (-P: nothing of the
checkout on sys.path, not even this folder, whose megatron.py would shadow megatron) so that only an installed
gdn_compat could be found; with ``GDN_COMPAT_AUTO=1`` the installed ``gdn_compat_auto.pth`` must make it work, without
it the release raises its own NotImplementedError. Prints one JSON line: ok, error, what gdn_compat applied (read from
``sys.modules``, never imported here), where it was imported from. ``run()`` is the same for a Ray actor.
Standard library, torch and megatron-core only; CPU stand-ins as tests/support/megatron.py has them.
"""

from __future__ import annotations

import json
import logging
import sys


def run() -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.cuda.current_device = lambda: "cpu"  # GatedDeltaNet's constructor asks for it
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    torch._dynamo.config.disable = True  # jit_fuser would compile per shape on the CPU, slowly
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                            linear_num_key_heads=2, linear_num_value_heads=4, normalization="RMSNorm",
                            activation_func=F.silu, params_dtype=torch.float32, perform_initialization=False)
    sub = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear)
    layer = GatedDeltaNet(cfg, sub, layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    with torch.no_grad():  # megatron's own init forks a CUDA RNG: values of our own instead
        for p in layer.parameters():
            p.normal_(0, 0.1)
    cu = torch.tensor([0, 5, 12, 13], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    x = torch.randn(13, 1, 32, requires_grad=True)
    result: dict = {}
    try:
        out, _ = layer(x, None, packed_seq_params=psp)
        out.sum().backward()
        result.update(ok=True, grad_finite=bool(torch.isfinite(x.grad).all()))
    except NotImplementedError as exc:
        result.update(ok=False, error=f"NotImplementedError: {exc}")
    compat = sys.modules.get("gdn_compat")
    result["gdn_compat"] = None if compat is None else {"file": compat.__file__, "applied": list(compat.report().applied)}
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    print(json.dumps(run()))
