"""gdn_out_norm_tp_grad: sum GatedDeltaNet's out_norm gradient over tensor-parallel ranks.

``GatedDeltaNet.out_norm`` normalises every value head with one weight vector that each
tensor-parallel rank holds a copy of, while each rank sees only its own heads: each rank's gradient
is partial and the true one is their sum. ``finalize_model_grads`` sums TP-replicated gradients only
for parameters marked ``sequence_parallel`` (with sequence parallelism on) or named q/k layernorm,
so with tp > 1 and sequence parallelism off (or an out_norm whose weight is not marked) every rank
applies its own partial gradient and the copies drift apart (upstream issue #7452, open; no release
fixes it, 0.16.x-0.19.x alike).

The replacement is the release's ``_allreduce_non_tensor_model_parallel_grads`` (which
``finalize_model_grads`` looks up at call time), followed by one coalesced all-reduce (sum) over the
tensor-parallel group of exactly the GDN out_norm gradients the release left alone: those neither
averaged (``average_gradients_across_tp_domain``) nor summed by it (``sequence_parallel`` with
sequence parallelism on). So a gradient is summed once, never twice.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from gdn_compat._probe import FINALIZE_MODULE, Accepts, Facts, Layout, fla_problem
from gdn_compat._registry import Patch, Target


def decide(facts: Facts) -> str | None:
    if facts.gdn is Layout.ABSENT:
        return f"{facts.release} has no GatedDeltaNet"
    if facts.gdn is Layout.UNKNOWN and fla_problem(facts):  # a broken fla breaks the import of megatron's GDN
        return f"not patched: {fla_problem(facts)}"
    if facts.gdn_out_norm_tp_sum is Accepts.YES:
        return f"{facts.release} finalize_model_grads already sums GatedDeltaNet out_norm grads over tp"
    if facts.gdn_out_norm_tp_sum is not Accepts.NO:
        return f"not patched: {facts.notes.get('gdn_out_norm_tp_sum', 'unknown finalize_model_grads shape')}"
    return None


def summed_by_release(param: Any, config: Any) -> bool:
    """The release's own selection in _allreduce_non_tensor_model_parallel_grads (averaged or summed)."""
    return bool(getattr(param, "average_gradients_across_tp_domain", False)
                or (config.sequence_parallel and getattr(param, "sequence_parallel", False)))


def per_head_out_norm(module: Any) -> bool:
    """The hole's shape, whatever the class is called (GatedDeltaNet, main's GatedDeltaNet2, a subclass): an
    ``out_norm`` with one weight of the value head dim, applied to every value head, while tensor parallelism
    splits the heads; each rank's gradient of that replicated weight then covers only its own heads."""
    norm = getattr(module, "out_norm", None)
    weight = getattr(norm, "weight", None)
    dv, heads = getattr(module, "value_head_dim", None), getattr(module, "num_value_heads", None)
    return (isinstance(weight, torch.Tensor) and isinstance(dv, int) and isinstance(heads, int) and heads > 1
            and tuple(weight.shape) == (dv,))


def build(facts: Facts, original: Any) -> Any:
    release = sys.modules[original.__module__]

    def out_norm_grads(model: list, config: Any) -> list[tuple[Any, str, torch.Tensor]]:
        found = []
        for chunk in model:
            fsdp = chunk.ddp_config.use_megatron_fsdp
            for module in release.get_attr_wrapped_model(chunk, "modules")():
                if not per_head_out_norm(module):
                    continue
                for param in module.out_norm.parameters():
                    attr = release._get_main_grad_attr(param)
                    grad = getattr(param, attr)
                    if param.requires_grad and grad is not None and not summed_by_release(param, config):
                        found.append((param, attr, grad._local_tensor.data if fsdp
                                      else release._unshard_if_dtensor(grad).data))
        return found

    @functools.wraps(original)
    def _allreduce_non_tensor_model_parallel_grads(model, config, tp_group=None):
        original(model, config, tp_group)
        group = release.get_tensor_model_parallel_group_if_none(tp_group)
        if group.size() <= 1:
            return
        found = out_norm_grads(model, config)
        if not found:
            return
        grads = [g for _, _, g in found]
        coalesced = _flatten_dense_tensors(grads)
        torch.distributed.all_reduce(coalesced, op=torch.distributed.ReduceOp.SUM, group=group)
        for (param, attr, buf), synced in zip(found, _unflatten_dense_tensors(coalesced, grads)):
            buf.copy_(synced)
            if not model[0].ddp_config.use_megatron_fsdp:
                setattr(param, attr, release._reshard_if_dtensor(buf, getattr(param, attr)))

    return _allreduce_non_tensor_model_parallel_grads


PATCH = Patch(
    name="gdn_out_norm_tp_grad",
    target=Target(FINALIZE_MODULE, "", "_allreduce_non_tensor_model_parallel_grads"),
    decide=decide,
    build=build,
    summary="finalize_model_grads also sums GatedDeltaNet out_norm grads over tensor-parallel ranks where the "
            "release leaves them partial (tp > 1 without a sequence-parallel-marked norm; upstream #7452)",
)
