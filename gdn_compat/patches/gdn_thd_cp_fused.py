"""gdn_thd_cp_fused: packed GDN with context parallelism on megatron-core 0.18.x, one all-to-all each way.

0.18's native ``GatedDeltaNet.forward`` splits a pack with ``_unpack_sequence`` (a ``.tolist()`` of the
offsets) and runs one all-to-all per sequence before and after the kernels, after reading the offsets
on the host in ``_resolve_cu_seqlens``; measured on 2 H200s at 16k tokens, cp = 2: 35.02 ms per rank
against 13.85 ms for gdn_thd's fused path on 0.17.1. Upstream fused it in 0.19.0 (#4913). This patch
routes 0.18's packed calls with cp > 1 through gdn_thd's packed path: the same math (Megatron's
load-balanced layout undone by one permutation, the release's kernels on all tokens of this rank's
heads), one all-to-all each way and no host sync once the pack is known. cp = 1, unpacked input and
inference stay the release's forward. On by default; ``apply(gdn_thd_cp_fused=False)`` turns it off.
"""

from __future__ import annotations

from typing import Any

from gdn_compat._probe import GDN_MODULE, Facts
from gdn_compat._registry import Patch, Target
from gdn_compat.patches.gdn_thd import carrier_skip, route
from gdn_compat.patches.gdn_thd import context_parallel as cpx


def decide(facts: Facts) -> str | None:
    if facts.gdn_native_shape and not facts.gdn_cp_per_sequence:  # 0.19: not needed, whatever fla is installed
        return f"{facts.release} GatedDeltaNet runs packed context parallelism with one all-to-all per pack (upstream #4913)"
    return carrier_skip(facts, "gdn_thd's context parallelism is fused already")


def build(facts: Facts, original: Any) -> Any:
    return route(facts, original, lambda layer: cpx.size_of(layer) > 1)


PATCH = Patch(
    name="gdn_thd_cp_fused",
    target=Target(GDN_MODULE, "GatedDeltaNet", "forward"),
    decide=decide,
    build=build,
    summary="GatedDeltaNet.forward runs packed sequences under context parallelism with one all-to-all each way "
            "and no host sync (0.18 runs one per sequence; fused upstream in 0.19.0, #4913); cp = 1, unpacked "
            "input and inference are the release's",
)
