"""A small real GPTModel with one MoE MTP layer (local spec, no Transformer Engine), CPU or GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 128, 16, 2


def build_gpt(recompute: bool, device: str = "cpu", dtype=torch.float32, hidden: int = 64, seed: int = 0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig

    from tests.support.megatron import moe_without_te

    moe_without_te()
    torch.manual_seed(seed)
    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    cfg = TransformerConfig(
        num_layers=2, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=2 * hidden,
        use_cpu_initialization=(device == "cpu"), params_dtype=dtype, bf16=(dtype == torch.bfloat16),
        mtp_num_layers=1, mtp_loss_scaling_factor=0.3,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=hidden, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.5, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, activation_func=F.silu, **extra,
    )
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False)
    mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)
    model = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ, mtp_block_spec=mtp)
    return model.to(device=device, dtype=dtype)


def batch(device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[0, -5:] = True  # real padded positions (True = padding), as GPTModel expects
    padding[1, -2:] = True
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.tril(torch.ones(SEQ, SEQ)).logical_not().view(1, 1, SEQ, SEQ)
    return {k: v.to(device) for k, v in dict(input_ids=tokens, position_ids=position_ids, attention_mask=mask,
                                              labels=labels, padding_mask=padding).items()}


def loss_and_grads(model, data, use_mask=True):
    """One training step's total loss (LM + MTP + router aux, as backward sees them) and gradients."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    model.train()
    model.zero_grad(set_to_none=True)
    kwargs = dict(data)
    if not use_mask:
        kwargs.pop("padding_mask")
    lm = model(**kwargs)  # [b, s] per-token LM loss; MTP and aux losses ride on autograd
    keep = (~data["padding_mask"]).float()
    loss = (lm.float() * keep).sum() / keep.sum()
    loss.backward()
    clear_aux_losses_tracker()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def te_like_checkpoint(function, distribute_saved_activations, get_rng_tracker, tp_group, *args, **kwargs):
    """Transformer Engine's ``checkpoint`` as its source behaves (``transformer_engine/pytorch/distributed.py``):
    positional tensors are the autograd Function's inputs and are saved; keyword arguments are kept in the
    context and handed to the recompute as they are, so they are no inputs of the Function and get no
    gradient through it. (RNG-state handling left out: the stand-in layers here draw no random numbers.)"""

    class _Checkpoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            ctx.save_for_backward(*inputs)
            with torch.no_grad():
                return function(*inputs, **kwargs)

        @staticmethod
        def backward(ctx, *grads):
            detached = tuple(t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                             for t in ctx.saved_tensors)
            with torch.enable_grad():
                outputs = function(*detached, **kwargs)
            outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
            torch.autograd.backward(outputs, grads)
            return tuple(t.grad if isinstance(t, torch.Tensor) else None for t in detached)

    return _Checkpoint.apply(*args)
