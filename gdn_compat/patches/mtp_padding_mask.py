"""mtp_padding_mask: MTP with full activation recompute on megatron-core 0.18.x.

``MultiTokenPredictionLayer.forward`` passes ``padding_mask=`` to ``_checkpointed_forward``, which
has no such parameter (PR #2645 added the call-site argument, PR #4593 rewrote the method without
it; issue #4933), so ``recompute_granularity='full'`` dies with a TypeError. Fixed upstream in 0.19.0.

The replacement is the release's method with ``padding_mask`` threaded through every branch the way
the release threads its other tensors: positionally through ``tensor_parallel.checkpoint`` and
``te_checkpoint`` (so the recompute in backward sees it too), keyword into the 'block' fallback.
The release's module globals are looked up at call time, so everything else stays the release's.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

from gdn_compat._probe import MTP_MODULE, Facts
from gdn_compat._registry import Patch

NAME = "mtp_padding_mask"
TARGET = f"{MTP_MODULE}.MultiTokenPredictionLayer._checkpointed_forward"


def decide(facts: Facts) -> str | None:
    mc = f"megatron-core {facts.megatron}"
    if facts.mtp == "absent":
        return f"{mc} has no MultiTokenPredictionLayer"
    if facts.mtp == "generic":
        return (f"{mc} MultiTokenPredictionLayer._checkpointed_forward is the generic forward_func "
                f"form and forward never passes padding_mask to it")
    if facts.mtp == "has_padding_mask":
        return f"{mc} already accepts padding_mask in MultiTokenPredictionLayer._checkpointed_forward"
    if facts.mtp != "no_padding_mask":
        return f"not patched, unknown MultiTokenPredictionLayer shape: {facts.mtp}"
    return None


def build() -> list[tuple[Any, str, Any]]:
    cls = importlib.import_module(MTP_MODULE).MultiTokenPredictionLayer
    original = cls.__dict__["_checkpointed_forward"]
    release = sys.modules[cls.__module__]

    @functools.wraps(original)
    def _checkpointed_forward(self, hidden_states, decoder_input, attention_mask=None, padding_mask=None,
                              context=None, context_mask=None, rotary_pos_emb=None, rotary_pos_cos=None,
                              rotary_pos_sin=None, attention_bias=None, inference_params=None,
                              packed_seq_params=None, sequence_len_offset=None):
        # Tensors (and None) go positionally through the checkpoint function, non-tensors ride in
        # the closure: the release's own rule, now applied to padding_mask as well.
        tensors = (hidden_states, decoder_input, attention_mask, padding_mask, context, context_mask,
                   rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset)

        def custom_forward(hidden_states, decoder_input, attention_mask, padding_mask, context,
                           context_mask, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset):
            return self._proj_and_transformer_layer(
                hidden_states=hidden_states, decoder_input=decoder_input, attention_mask=attention_mask,
                padding_mask=padding_mask, context=context, context_mask=context_mask,
                rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                attention_bias=attention_bias, inference_params=inference_params,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
            )

        config = self.config
        if config.recompute_method == "uniform":
            assert config.recompute_num_layers == 1, "recompute_num_layers must be 1 for MTP recompute"
            # fp8 delayed scaling needs the quantization context entered before te_checkpoint.
            if config.fp8 and config.fp8_recipe == release.Fp8Recipe.delayed:
                outer = release.get_fp8_context(config)
            else:
                outer = release.nullcontext()
            with outer:
                if config.fp8 or getattr(config, "fp4", None):
                    from megatron.core.extensions.transformer_engine import te_checkpoint

                    return te_checkpoint(
                        custom_forward, config.distribute_saved_activations,
                        release.tensor_parallel.random.get_cuda_rng_tracker,
                        release.parallel_state.get_tensor_model_parallel_group(), *tensors,
                    )
                return release.tensor_parallel.checkpoint(
                    custom_forward, config.distribute_saved_activations, *tensors
                )
        if config.recompute_method == "block":
            release.warnings.warn("recompute_method == 'block' is not supported for MTP yet. Skipping recompute.")
            return custom_forward(*tensors)
        raise ValueError("Invalid activation recompute method.")

    return [(cls, "_checkpointed_forward", _checkpointed_forward)]


PATCH = Patch(
    name=NAME,
    target=TARGET,
    decide=decide,
    build=build,
    summary="MultiTokenPredictionLayer._checkpointed_forward accepts padding_mask and passes it "
            "positionally through the recompute (upstream issue #4933, fixed in 0.19.0)",
)
