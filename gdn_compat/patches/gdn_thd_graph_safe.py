"""gdn_thd_graph_safe (opt-in): packed GDN on megatron-core 0.18.x/0.19.x through gdn_compat's graph-safe path.

Their native THD ``GatedDeltaNet.forward`` reads the offsets on the host in every call
(``_resolve_cu_seqlens``, and fla's ``prepare_chunk_indices`` ``.tolist()``) and sizes kernels by the
number of chunks, so a packed GDN step cannot be captured in a CUDA graph (upstream #6796, open).
With this switch on, every packed (``qkv_format='thd'``) call that has no inference context runs
gdn_thd's packed path instead: the same projections, fla kernels, gated norm and context-parallel
all-to-alls as the release, with the pack's chunk indices handed to fla, so that under capture (or
for a ``gdn_compat.graphs.PackBuffer``) nothing is read on the host and one capture replays any
layout (``gdn_thd/pack.py``). Eager results are bitwise native's where the kernels coincide (README).
Off by default: ``apply(gdn_thd_graph_safe=True)`` or ``GDN_COMPAT_ENABLE=gdn_thd_graph_safe``.
Unpacked calls and inference are the release's own forward.
"""

from __future__ import annotations

from typing import Any

from gdn_compat._probe import GDN_MODULE, Facts
from gdn_compat._registry import Patch, Target
from gdn_compat.patches.gdn_thd import carrier_skip, route


def decide(facts: Facts) -> str | None:
    skip = carrier_skip(facts, "gdn_thd's packed path is graph-safe there")
    if skip:
        return skip
    if not facts.fla_varlen.graph_safe:
        return (f"not patched: {facts.fla or 'fla'} takes no chunk indices (chunk_gated_delta_rule "
                f"{facts.fla_varlen.rule_chunks}, its forward/backward {facts.fla_varlen.rule_inner}, causal_conv1d "
                f"{facts.fla_varlen.conv_chunks}); install fla-core>=0.4.2")
    return None


def build(facts: Facts, original: Any) -> Any:
    return route(facts, original, lambda layer: True)


PATCH = Patch(
    name="gdn_thd_graph_safe",
    target=Target(GDN_MODULE, "GatedDeltaNet", "forward"),
    decide=decide,
    build=build,
    summary="GatedDeltaNet.forward runs packed sequences (THD) through gdn_compat's graph-safe packed path (no host "
            "read of the offsets, CUDA-graph capture that survives a new pack, upstream #6796); unpacked calls "
            "and inference are the release's",
    opt_in=True,
)
