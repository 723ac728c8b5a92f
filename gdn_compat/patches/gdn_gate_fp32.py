"""gdn_gate_fp32 (opt-in): GatedDeltaNet's decay gate with the exp of ``A_log`` in fp32, as the rollout engines do.

Every release computes ``g = -A_log.exp() * softplus(alpha.float() + dt_bias)``. Under megatron's
Float16Module ``A_log`` is bf16, so the exp runs in bf16 (its comment says "In fp32"), while HF transformers
and vLLM take the exp of ``A_log.float()``. Measured (``benchmarks/gate_precision.py``, CPU): the decay rate
per head is off by up to 3e-3 relative, and a packed bf16 GDN model's per-token log-probs move by 0.0058 on
average, about 60% of the whole bf16-vs-fp32 gap: material for RL's train/rollout agreement.

The replacement of 0.18/0.19's ``GatedDeltaNet._compute_g_and_beta`` computes ``-A_log.float().exp()``;
everything else is the release's expression, fused the same way (megatron's ``jit_fuser``). gdn_compat's
own packed path calls the layer's method where it has one, so packed and unpacked calls agree. Off by
default (native bitwise behaviour holds unless asked): ``apply(gdn_gate_fp32=True)`` or
``GDN_COMPAT_ENABLE=gdn_gate_fp32``. 0.16/0.17 compute the gate inline in ``forward``; gdn_compat does not
rewrite the release's unpacked path, so the patch is skipped there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gdn_compat._probe import GDN_MODULE, Facts, Layout
from gdn_compat._registry import Patch, Target


def decide(facts: Facts) -> str | None:
    mc = facts.release
    if facts.gdn in (Layout.ABSENT, Layout.UNKNOWN):
        return f"{mc} has no GatedDeltaNet" if facts.gdn is Layout.ABSENT else "GatedDeltaNet not readable"
    if facts.gdn_gate_exp == "absent":
        return (f"{mc} GatedDeltaNet computes its gate inline in forward; gdn_compat does not rewrite the "
                f"release's unpacked path (0.16/0.17)")
    if facts.gdn_gate_exp == "fp32":
        return f"{mc} GatedDeltaNet._compute_g_and_beta already takes the exp of A_log in fp32"
    if facts.gdn_gate_exp != "parameter dtype":
        return "not patched, unknown GatedDeltaNet._compute_g_and_beta shape"
    return None


def gate_fp32(A_log_local_cp: torch.Tensor, dt_bias_local_cp: torch.Tensor, alpha: torch.Tensor,
              beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = -A_log_local_cp.float().exp() * F.softplus(alpha.float() + dt_bias_local_cp)
    return g, beta.sigmoid()


def build(facts: Facts, original: Any) -> Any:
    from megatron.core.jit import jit_fuser

    fused = jit_fuser(gate_fp32)

    def _compute_g_and_beta(self, A_log_local_cp, dt_bias_local_cp, alpha, beta):
        """The release's gate with the exp of A_log in fp32 (gdn_compat gdn_gate_fp32)."""
        return fused(A_log_local_cp, dt_bias_local_cp, alpha, beta)

    return _compute_g_and_beta


PATCH = Patch(
    name="gdn_gate_fp32",
    target=Target(GDN_MODULE, "GatedDeltaNet", "_compute_g_and_beta"),
    decide=decide,
    build=build,
    summary="GatedDeltaNet._compute_g_and_beta takes the exp of A_log in fp32 (as HF transformers and vLLM do) "
            "instead of the parameter dtype (bf16 under Float16Module)",
    opt_in=True,
)
