"""gdn_gate_fp32 (opt-in): GatedDeltaNet's decay gate with the exp of ``A_log`` in fp32 where the release's runs in bf16.

Every release writes ``g = -A_log.exp() * softplus(alpha.float() + dt_bias)``. Under megatron's Float16Module
``A_log`` is bf16, and *eagerly* that exp runs in bf16 (the comment says "In fp32"), while HF transformers and
vLLM take the exp of ``A_log.float()``. But 0.18/0.19 compute it in ``_compute_g_and_beta`` under megatron's
``jit_fuser``, which is ``torch.compile``: inductor loads the bf16 value, computes in fp32 and rounds only at the
store, so in megatron's default configuration the compiled gate is already the fp32 formula (CPU inductor:
within 1.6e-7; H200, torch 2.11: bitwise this patch's gate). The patch therefore applies only where the gate
runs eagerly (dynamo disabled, e.g. ``TORCHDYNAMO_DISABLE=1``, or megatron's ``disable_jit_fuser()`` before the
model is imported), and says so when it skips. There, measured (``benchmarks/gate_precision.py``, CPU, dynamo
off): the decay rate per head is off by up to 3e-3 relative, and a packed bf16 GDN model's per-token log-probs
move by 0.0058 on average, about 60% of the whole bf16-vs-fp32 gap.

The replacement of ``_compute_g_and_beta`` computes ``-A_log.float().exp()``; everything else is the release's
expression, fused the same way (megatron's ``jit_fuser``). gdn_compat's own packed path calls the layer's method
where it has one, so packed and unpacked calls agree. Off by default: ``apply(gdn_gate_fp32=True)`` or
``GDN_COMPAT_ENABLE=gdn_gate_fp32``. 0.16/0.17 compute the gate inline in ``forward`` (eager bf16 in their
unpacked path; gdn_compat's packed path uses 0.18's compiled gate, fp32 in effect): skipped there, and
``gdn_thd_unpacked`` is the switch that gives their unpacked calls the packed path's gate. main's
``_compute_gates`` is another shape: skipped with its name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gdn_compat._probe import GDN_MODULE, Accepts, Facts, Layout, fla_problem
from gdn_compat._registry import Patch, Target


def decide(facts: Facts) -> str | None:
    mc = facts.release
    if facts.gdn is Layout.UNKNOWN and fla_problem(facts):  # a broken fla breaks the import of megatron's GDN
        return f"not patched: {fla_problem(facts)}"
    if facts.gdn in (Layout.ABSENT, Layout.UNKNOWN):
        return f"{mc} has no GatedDeltaNet" if facts.gdn is Layout.ABSENT else "GatedDeltaNet not readable"
    if facts.gdn_gate_exp == "absent":
        return (f"{mc} GatedDeltaNet computes its gate inline in forward: its own unpacked path takes the exp of a bf16 "
                f"A_log in bf16, gdn_compat's packed path runs 0.18's compiled gate (fp32 in effect); gdn_compat does "
                f"not rewrite the release's unpacked path unless asked (apply(gdn_thd_unpacked=True))")
    if facts.gdn_gate_exp == "fp32":
        return f"{mc} GatedDeltaNet.{facts.gdn_gate_method} already takes the exp of A_log in fp32"
    if facts.gdn_gate_compiled is Accepts.YES and facts.gdn_gate_exp == "parameter dtype":
        return (f"{mc} GatedDeltaNet.{facts.gdn_gate_method} runs compiled (megatron's jit_fuser is torch.compile), "
                f"and inductor takes the exp of a bf16 A_log in fp32 already (measured: within 1.6e-7 of the fp32 "
                f"formula on the CPU, bitwise this patch's gate on an H200): nothing to change. It applies where the "
                f"gate runs eagerly (dynamo disabled, or jit_fuser disabled before the model was imported)")
    if facts.gdn_gate_method != "_compute_g_and_beta":
        return (f"not patched, unknown gate shape: {mc} computes its gate in GatedDeltaNet.{facts.gdn_gate_method} "
                f"(main's _compute_gates returns (g, {{'beta': ...}})); gdn_gate_fp32 replaces only 0.18/0.19's "
                f"_compute_g_and_beta")
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
