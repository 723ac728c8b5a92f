"""gdn_thd_deterministic: packed sequences (THD) in ``deterministic_mode`` on megatron-core 0.18.x/0.19.x.

Their ``GatedDeltaNet.forward`` handles THD through fla's kernels but asserts "Packed sequence does
not support deterministic mode." (upstream lists it as an open gap of its determinism work, #5718;
verl rejects the combination, #6559), so RL users who need repeatable steps cannot pack.

The replacement wraps the release's forward and takes over exactly one case, deterministic mode
with ``qkv_format='thd'``: it runs gdn_thd's packed path (the same projections, norm and context
parallel all-to-alls as the release). Its core on CUDA is fla's varlen kernels, the release's own THD
kernels, when the probe finds the fla code they reach free of atomics and scatter-adds
(``Facts.fla_atomic_free``; upstream's "FLA is not deterministic" was measured false for these kernels
at fixed shapes, README "Deterministic packed GDN"); on the CPU, or when fla has atomics, it is the
pure-torch core the release itself uses for deterministic unpacked input (a depthwise ``F.conv1d`` and
``torch_chunk_gated_delta_rule``), one sequence at a time. Either way no state crosses a boundary.
Every other call is the release's own forward.
"""

from __future__ import annotations

from typing import Any

from gdn_compat._probe import GDN_MODULE, Accepts, Facts
from gdn_compat._registry import Patch, Target
from gdn_compat.patches.gdn_thd import carrier_skip, route


def decide(facts: Facts) -> str | None:
    skip = carrier_skip(facts, "gdn_thd's packed path covers deterministic mode there")
    if skip:
        return skip
    if facts.gdn_thd_deterministic is not Accepts.NO:
        return f"not patched: {facts.notes.get('gdn_thd_deterministic', 'unknown GatedDeltaNet shape')}"
    return None


REFUSAL = ("gdn_compat: packed sequences in deterministic_mode run gdn_compat's packed path (the release's own forward "
           "refuses them), which cannot take this layer: {why}. Run it without deterministic_mode, or unpacked")


def build(facts: Facts, original: Any) -> Any:
    return route(facts, original, lambda layer: layer.config.deterministic_mode, must=REFUSAL)


PATCH = Patch(
    name="gdn_thd_deterministic",
    target=Target(GDN_MODULE, "GatedDeltaNet", "forward"),
    decide=decide,
    build=build,
    summary="GatedDeltaNet.forward runs packed sequences (THD) in deterministic_mode instead of asserting "
            "(upstream #5718): fla's varlen kernels when their code is atomic-free, else a per-sequence torch "
            "core; every other call is the release's",
)
