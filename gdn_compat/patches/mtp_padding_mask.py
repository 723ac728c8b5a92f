"""mtp_padding_mask: MTP with full activation recompute on megatron-core 0.18.x.

``MultiTokenPredictionLayer.forward`` passes ``padding_mask=`` to ``_checkpointed_forward``, which
has no such parameter (PR #2645 added the call-site argument, PR #4593 rewrote the method without
it; issue #4933), so ``recompute_granularity='full'`` dies with a TypeError. Fixed upstream in 0.19.0.

The replacement is the release's method with ``padding_mask`` threaded through every branch the way
the release threads its other tensors: positionally through ``tensor_parallel.checkpoint`` and
``te_checkpoint`` (so the recompute in backward sees it too), keyword into the 'block' fallback.
The release's positional parameters keep their order; ``padding_mask`` is keyword-only, and the
replacement's ``__signature__`` shows it.
The release's module globals are looked up at call time, so everything else stays the release's.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from gdn_compat._probe import MTP_MODULE, Facts, Mtp
from gdn_compat._registry import Patch, Target


def decide(facts: Facts) -> str | None:
    mc = facts.release
    if facts.mtp is Mtp.ABSENT:
        return f"{mc} has no MultiTokenPredictionLayer"
    if facts.mtp is Mtp.GENERIC:
        return (f"{mc} MultiTokenPredictionLayer._checkpointed_forward is the generic forward_func "
                f"form and forward never passes padding_mask to it")
    if facts.mtp is Mtp.HAS_PADDING_MASK:
        return f"{mc} already accepts padding_mask in MultiTokenPredictionLayer._checkpointed_forward"
    if facts.mtp is not Mtp.NO_PADDING_MASK:
        return f"not patched, unknown MultiTokenPredictionLayer shape: {facts.notes.get('mtp', facts.mtp)}"
    return None


def _signature(original: Any) -> inspect.Signature:
    """The release's signature, positional order untouched, plus a keyword-only ``padding_mask``."""
    sig = inspect.signature(original)
    mask = inspect.Parameter("padding_mask", inspect.Parameter.KEYWORD_ONLY, default=None)
    return sig.replace(parameters=[*sig.parameters.values(), mask])


def build(facts: Facts, original: Any) -> Any:
    """The replacement ``_checkpointed_forward``; ``original`` is the release's (0.18.x)."""
    release = sys.modules[original.__module__]

    # The release's 0.18.x positional order exactly (a caller passing its arguments positionally
    # keeps working); padding_mask is keyword-only, so it cannot shift anything.
    def _checkpointed_forward(self, hidden_states, decoder_input, attention_mask=None, context=None,
                              context_mask=None, rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                              attention_bias=None, inference_params=None, packed_seq_params=None,
                              sequence_len_offset=None, *, padding_mask=None):
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

        return _recompute(self.config, release, custom_forward, tensors)

    functools.update_wrapper(_checkpointed_forward, original)
    _checkpointed_forward.__signature__ = _signature(original)  # type: ignore[attr-defined]
    return _checkpointed_forward


def _recompute(config: Any, release: Any, custom_forward: Any, tensors: tuple[Any, ...]) -> Any:
    """The release's three branches: uniform via tensor_parallel.checkpoint or (fp8/fp4)
    te_checkpoint inside the fp8 context for delayed scaling, and the 'block' fallback."""
    if config.recompute_method == "uniform":
        assert config.recompute_num_layers == 1, "recompute_num_layers must be 1 for MTP recompute"
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
            return release.tensor_parallel.checkpoint(custom_forward, config.distribute_saved_activations, *tensors)
    if config.recompute_method == "block":
        release.warnings.warn("recompute_method == 'block' is not supported for MTP yet. Skipping recompute.")
        return custom_forward(*tensors)
    raise ValueError("Invalid activation recompute method.")


PATCH = Patch(
    name="mtp_padding_mask",
    target=Target(MTP_MODULE, "MultiTokenPredictionLayer", "_checkpointed_forward"),
    decide=decide,
    build=build,
    summary="MultiTokenPredictionLayer._checkpointed_forward accepts padding_mask and passes it "
            "positionally through the recompute (upstream issue #4933, fixed in 0.19.0)",
)
