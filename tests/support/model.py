"""A Qwen3-Next-style GPTModel built the way a user builds it, from megatron-core's own classes.

``TransformerConfig(experimental_attention_variant='gated_delta_net', ...)``, the release's
``TransformerLayer`` / ``TransformerBlock`` / ``GPTModel``, rotary positions, layers of GatedDeltaNet
followed by a SwiGLU MLP. The release's GDN spec helper insists on Transformer Engine, so the
layer spec is built by hand from local modules (ColumnParallelLinear in_proj, RowParallelLinear
out_proj). Attention layers are left out: THD attention needs Transformer Engine or flash-attn.

Also: the parameter layout under tensor parallelism (``split``/``join`` between the full tp = 1
tensor and a rank's shard, section by section as megatron lays out GDN's fused projections) and
the per-sequence reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

VOCAB = 128
SHAPE = dict(hidden=64, dk=8, dv=8, hk=4, hv=8, ffn=96)  # heads divide by tp x cp = 4


class SPNorm(torch.nn.RMSNorm):
    """torch's RMSNorm (its own forward) whose weight says it is replicated over a sequence-parallel region, as
    TE's norm does (megatron's own torch norm refuses sequence_parallel); finalize_model_grads sums its grad.
    As GDN's out_norm it is a norm gdn_fused's gated norm runs (tests/test_acceptance.py checks that it does)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


MTP_SCALE = 0.3  # mtp_loss_scaling_factor


EXPERTS = 4


def config(tp: int = 1, sp: bool = False, cp: int = 1, recompute: bool = False, layers: int = 4,
           deterministic: bool = False, shape: dict | None = None, bf16: bool = False, mtp: bool = False,
           moe: bool = False):
    """``mtp``: one MTP layer, its loss per token (``calculate_per_token_loss``: summed, not averaged,
    so a pack's gradients are the sum of its sequences' up to the release's MTP weighting).
    ``moe``: every second layer's MLP is a mixture of 4 experts, top-2, without capacity limits or
    load-balancing loss, so a token's route does not depend on the other tokens of its micro-batch."""
    import torch
    from megatron.core.transformer import TransformerConfig

    shape = shape or SHAPE
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    if mtp:
        extra.update(mtp_num_layers=1, mtp_loss_scaling_factor=MTP_SCALE, calculate_per_token_loss=True)
    if moe:
        extra.update(num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=shape["ffn"] // 2,
                     moe_layer_freq=[i % 2 for i in range(layers)], moe_router_load_balancing_type="none",
                     moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather")
    return TransformerConfig(
        num_layers=layers, hidden_size=shape["hidden"], num_attention_heads=4, ffn_hidden_size=shape["ffn"],
        experimental_attention_variant="gated_delta_net", linear_attention_freq=[1] * layers,
        linear_conv_kernel_dim=4, linear_key_head_dim=shape["dk"], linear_value_head_dim=shape["dv"],
        linear_num_key_heads=shape["hk"], linear_num_value_heads=shape["hv"],
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        tensor_model_parallel_size=tp, sequence_parallel=sp, context_parallel_size=cp, cp_comm_type="p2p" if cp > 1 else None,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, deterministic_mode=deterministic,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        **extra,
    )


@functools.lru_cache(maxsize=1)
def _causal_gdn():
    """GatedDeltaNet that takes ``attn_mask_type``: megatron's MTP layer insists its inner layer's
    self-attention spec names a causal mask; GDN is causal by construction and takes no mask type."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class CausalGatedDeltaNet(GatedDeltaNet):
        def __init__(self, *args, attn_mask_type=None, **kwargs):
            super().__init__(*args, **kwargs)

    return CausalGatedDeltaNet


def block_spec(cfg, mtp: bool = False):
    """The decoder's layer specs (``mtp``: the one layer spec of the MTP layer's inner layer)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    gdn = ModuleSpec(module=_causal_gdn() if mtp else GatedDeltaNet,
                     params={"attn_mask_type": AttnMaskType.causal} if mtp else {},
                     submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=SPNorm,
                                                        out_proj=RowParallelLinear))
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    def layer(mlp):
        return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=SPNorm, self_attention=gdn, self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=SPNorm, mlp=mlp, mlp_bda=get_bias_dropout_add))

    dense = get_mlp_module_spec(use_te=False)
    if mtp:
        return layer(dense)
    if not cfg.num_moe_experts:
        return TransformerBlockSubmodules(layer_specs=[layer(dense)] * cfg.num_layers, layer_norm=SPNorm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from tests.support.megatron import moe_without_te

    moe_without_te()
    # the release's own local MoE spec (its helpers' signatures differ across releases)
    moe = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False).submodules.mlp
    return TransformerBlockSubmodules(layer_specs=[layer(moe if f else dense) for f in cfg.moe_layer_freq],
                                      layer_norm=SPNorm)


def build(cfg, seed: int = 0, device: str = "cpu"):
    from megatron.core.models.gpt import GPTModel

    if device != "cpu":
        # GatedDeltaNet initialises its conv weight, A_log and dt_bias on the GPU inside megatron's CUDA RNG tracker
        # (0.16-0.19 ``reset_parameters``), whose state torch.manual_seed does not reset: without this a second model
        # built in the same process got other GDN weights than the first from the same seed (#53: the training
        # benchmark's step-0 losses differed by up to 0.17 nats between configurations run one after another).
        # 1234 + seed: the first build in a process is what it always was (world() seeds the tracker with 1234).
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234 + seed)
    torch.manual_seed(seed)
    mtp = None
    if cfg.mtp_num_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp = get_gpt_mtp_block_spec(cfg, block_spec(cfg, mtp=True), use_transformer_engine=False)
    model = GPTModel(cfg, block_spec(cfg), vocab_size=VOCAB, max_sequence_length=8192, mtp_block_spec=mtp,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False).to(device)
    with torch.no_grad():  # norms start at 1 and GDN's A_log/dt_bias in narrow ranges: perturb all
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def _sections(name: str, shape: dict | None = None) -> tuple[int, list[int]] | None:
    """(partition dim, full section sizes) of a tensor-parallel parameter of a model of ``shape`` (default SHAPE);
    None when replicated."""
    shape = shape or SHAPE
    qk, v, hv, ffn = shape["dk"] * shape["hk"], shape["dv"] * shape["hv"], shape["hv"], shape["ffn"]
    table = {
        "self_attention.in_proj.weight": (0, [qk, qk, v, v, hv, hv]),
        "self_attention.conv1d.weight": (0, [qk, qk, v]),
        "self_attention.conv1d.bias": (0, [qk, qk, v]),
        "self_attention.A_log": (0, [hv]),
        "self_attention.dt_bias": (0, [hv]),
        "self_attention.out_proj.weight": (1, [v]),
        "mlp.linear_fc1.weight": (0, [ffn, ffn]),  # SwiGLU: [gate; up], each split over ranks
        "mlp.linear_fc2.weight": (1, [ffn]),
        "linear_fc1.weight": (0, [ffn // 2, ffn // 2]),  # an MoE expert's SwiGLU (moe_ffn_hidden_size)
        "linear_fc2.weight": (1, [ffn // 2]),
        "embedding.word_embeddings.weight": (0, [VOCAB]),
        "eh_proj.weight": (0, [shape["hidden"]]),  # MTP: ColumnParallelLinear, gather_output=False
        "output_layer.weight": (0, [VOCAB]),
    }
    return next((spec for suffix, spec in table.items() if name.endswith(suffix)), None)


def split(name: str, full: torch.Tensor, tp: int, rank: int, shape: dict | None = None) -> torch.Tensor:
    spec = _sections(name, shape)
    if spec is None or tp == 1:
        return full
    dim, sizes = spec
    return torch.cat([s.chunk(tp, dim)[rank] for s in full.split(sizes, dim)], dim)


def join(name: str, shards: list[torch.Tensor], shape: dict | None = None) -> torch.Tensor:
    spec = _sections(name, shape)
    if spec is None or len(shards) == 1:
        return shards[0]
    dim, sizes = spec
    tp = len(shards)
    parts = [s.split([n // tp for n in sizes], dim) for s in shards]
    return torch.cat([torch.cat([p[i] for p in parts], dim) for i in range(len(sizes))], dim)


def check_layout(model, tp: int) -> None:
    """Every parameter megatron marks tensor-parallel must be one this module knows how to split."""
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False) and tp > 1 and _sections(name) is None:
            raise AssertionError(f"{name} is tensor-parallel (dim {p.partition_dim}) but has no known layout")


def packed_batch(lengths: list[int], padded: list[int] | None, seed: int = 1):
    """Token ids, labels, a loss mask and PackedSeqParams for a pack laid out by ``padded`` slots."""
    from megatron.core.packed_seq_params import PackedSeqParams

    slots = padded or lengths
    gen = torch.Generator().manual_seed(seed)
    total = sum(slots)
    ids = torch.zeros(total, dtype=torch.long)
    labels = torch.zeros(total, dtype=torch.long)
    mask = torch.zeros(total)
    positions = torch.zeros(total, dtype=torch.long)
    start = 0
    for n, slot in zip(lengths, slots):
        ids[start:start + n] = torch.randint(1, VOCAB, (n,), generator=gen)
        labels[start:start + n] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[start:start + n] = 1
        positions[start:start + slot] = torch.arange(slot)
        start += slot

    def cu(sizes):
        out = [0]
        for n in sizes:
            out.append(out[-1] + n)
        return torch.tensor(out, dtype=torch.int32)

    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu(lengths), cu_seqlens_kv=cu(lengths),
                          cu_seqlens_q_padded=cu(slots) if padded else None,
                          cu_seqlens_kv_padded=cu(slots) if padded else None,
                          max_seqlen_q=max(slots), max_seqlen_kv=max(slots))
    return dict(ids=ids, labels=labels, mask=mask, positions=positions, psp=psp, slots=slots, lengths=lengths)
