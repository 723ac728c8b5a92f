"""mtp_checkpoint_args: MTP with full activation recompute on 0.15.x-0.17.x: packed sequences and fp8.

Their generic ``MultiTokenPredictionLayer._checkpointed_forward(self, forward_func, *args, **kwargs)``
gets every argument by keyword and mishandles them in both branches of ``recompute_method='uniform'``
(the 'block' branch runs without recompute):

* bf16/fp32: it hands ``*kwargs.values()`` to ``tensor_parallel.checkpoint``, whose ``save_for_backward``
  refuses any non-tensor: with a ``PackedSeqParams`` (THD, which gdn_thd makes reachable for GDN on
  0.16/0.17) the first step dies with ``TypeError: save_for_backward can only save variables, but
  argument N is of type PackedSeqParams`` (upstream issue #3643);
* fp8/fp4: it hands ``**kwargs`` to ``te_checkpoint``. Transformer Engine's ``checkpoint`` keeps keyword
  arguments in its autograd context and recomputes with them, but they are not inputs of its autograd
  Function: ``hidden_states`` and ``decoder_input`` get no gradient through the MTP layer, and the MTP
  layer's own parameters none either, without an error, packed or not (upstream PR #4765's discussion
  of the Qwen3.5 MXFP8 MTP loss gap).

Both were fixed in 0.18.0 by PR #4593, which rewrote the method.

The replacement keeps the release's branches and calls (``te_checkpoint`` with the release's RNG
tracker and tensor-parallel group under fp8, ``tensor_parallel.checkpoint`` otherwise) and changes
only what travels how, by the rule 0.18 adopted: tensors (and None) go positionally through the
checkpoint, so they are saved and the recompute sees them; every other object (``PackedSeqParams``,
``InferenceParams``) is bound in the closure, so the recompute in backward calls ``forward_func``
with the very same objects. Arguments reach ``forward_func`` by keyword, not by position.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from gdn_compat._probe import MTP_MODULE, Facts, Mtp
from gdn_compat._registry import Patch, Target


def decide(facts: Facts) -> str | None:
    mc = facts.release
    if facts.mtp is Mtp.ABSENT:
        return f"{mc} has no MultiTokenPredictionLayer"
    if facts.mtp in (Mtp.NO_PADDING_MASK, Mtp.HAS_PADDING_MASK):
        return (f"{mc} MultiTokenPredictionLayer._checkpointed_forward already passes non-tensors outside "
                f"the checkpoint (upstream PR #4593, 0.18.0)")
    if facts.mtp is not Mtp.GENERIC:
        return f"not patched, unknown MultiTokenPredictionLayer shape: {facts.notes.get('mtp', facts.mtp)}"
    return None


def split(args: tuple, kwargs: dict) -> tuple[tuple, list[str], dict]:
    """(what goes through the checkpoint, the names of its keyword part, what the closure binds)."""
    through = [k for k, v in kwargs.items() if v is None or isinstance(v, torch.Tensor)]
    bound = {k: v for k, v in kwargs.items() if k not in through}
    return (*args, *(kwargs[k] for k in through)), through, bound


def build(facts: Facts, original: Any) -> Any:
    release = sys.modules[original.__module__]

    @functools.wraps(original)
    def _checkpointed_forward(self, forward_func, *args, **kwargs):
        config = self.config
        if config.recompute_method == "block":  # the release runs it without recompute
            release.warnings.warn("recompute_method == 'block' is not supported for MTP yet. Skipping recompute.")
            return forward_func(*args, **kwargs)
        if config.recompute_method != "uniform":
            raise ValueError("Invalid activation recompute method.")
        assert config.recompute_num_layers == 1, "recompute_num_layers must be 1 for MTP recompute"
        flat, through, bound = split(args, kwargs)
        positional = len(args)

        def custom_forward(*saved):
            return forward_func(*saved[:positional], **dict(zip(through, saved[positional:])), **bound)

        if config.fp8:
            from megatron.core.extensions.transformer_engine import te_checkpoint

            return te_checkpoint(custom_forward, config.distribute_saved_activations,
                                 release.tensor_parallel.random.get_cuda_rng_tracker,
                                 release.parallel_state.get_tensor_model_parallel_group(), *flat)
        return release.tensor_parallel.checkpoint(custom_forward, config.distribute_saved_activations, *flat)

    return _checkpointed_forward


PATCH = Patch(
    name="mtp_checkpoint_args",
    target=Target(MTP_MODULE, "MultiTokenPredictionLayer", "_checkpointed_forward"),
    decide=decide,
    build=build,
    summary="MultiTokenPredictionLayer._checkpointed_forward passes tensors positionally through the recompute and "
            "binds non-tensors (PackedSeqParams) in its closure: MTP + full recompute runs with packed sequences "
            "(upstream issue #3643) and, under fp8, keeps the MTP gradients Transformer Engine's checkpoint drops "
            "for keyword tensors (PR #4765); fixed in 0.18.0 by PR #4593",
)
