"""gdn_cp_state (opt-in): packed context parallelism that passes the delta rule's state between ranks (#56).

Every release's GDN context parallelism (0.18/0.19's own, and gdn_thd's on 0.16/0.17) exchanges heads for tokens
with an all-to-all, so each rank runs whole sequences for ``value heads / (tp x cp)`` heads: cp is capped by the heads
a tensor-parallel rank holds, and every rank runs every token through the rule. With this switch on, a packed
(``qkv_format='thd'``) call at cp > 1 keeps each rank's own tokens, in megatron's load-balanced THD CP layout, with
all of its tensor-parallel rank's heads: the conv takes its halo from the slots before, and the delta rule's state
crosses slots and ranks (``gdn_thd/state_cp.py``: one run of the rule per rank gives its slots' outputs from a zero
state, their transitions and final states; one all_gather, the chain, and each token's correction from the state its
slot starts from). Upstream's dev branch has a mode like it (Megatron-LM #3282,
``linear_cp_mode='chunkwise'``, which refuses zero-length offsets entries); fla >= 0.6 has CP operators for the rule
(fla PR #691) that this path does not use yet.

Calls at cp = 1, unpacked calls and inference are the route below (the release's, or gdn_thd's). A graph-safe pack
(CUDA-graph capture, a ``PackBuffer``) at cp > 1 is refused with an error, as in every CP mode. Off by default:
``apply(gdn_cp_state=True)`` or ``GDN_COMPAT_ENABLE=gdn_cp_state``.
"""

from __future__ import annotations

import functools
from typing import Any

from gdn_compat._probe import GDN_MODULE, Facts
from gdn_compat._registry import Patch, Target
from gdn_compat.patches.gdn_thd import carrier_skip, needs_gdn_thd, route
from gdn_compat.patches.gdn_thd import context_parallel as cpx
from gdn_compat.patches.gdn_thd.fast import Fast


def decide(facts: Facts) -> str | None:
    return carrier_skip(facts)


def split_refusal(layer: Any) -> str | None:
    """Why ``layer`` cannot split its heads across its context-parallel ranks (None: it can, or cp = 1). With
    gdn_cp_state the config may hold heads that do not divide tp x cp (config_gdn_cp on 0.18/0.19; 0.16/0.17 check tp
    alone): only the calls that pass the state run those."""
    cp = cpx.size_of(layer)
    if cp == 1 or cpx.heads_divide(layer, cp):
        return None
    tp, hk, hv = layer.tp_size, layer.num_key_heads, layer.num_value_heads
    return (f"gdn_compat gdn_cp_state: this GatedDeltaNet call would split heads across the {cp} context-parallel "
            f"ranks, but its {hk} key and {hv} value heads do not divide tp x cp = {tp} x {cp}; only packed "
            f"(qkv_format='thd') training calls pass the state with every head (an unpacked call, inference, another "
            f"kernel backend or a layer whose release methods are replaced take the release's head all-to-all). Pack "
            f"the micro-batch, or use heads that divide tp x cp")


def build(facts: Facts, original: Any) -> Any:
    @functools.wraps(original)
    def release(self, *args, **kwargs):  # the calls that do not pass the state: refused where heads cannot split
        why = split_refusal(self)
        if why is not None:
            raise ValueError(why)
        return original(self, *args, **kwargs)

    return route(facts, release, lambda layer: True, Fast(state_cp=True),
                 wants=lambda layer, pack: cpx.size_of(layer) > 1)


PATCH = Patch(
    name="gdn_cp_state",
    target=Target(GDN_MODULE, "GatedDeltaNet", "forward"),
    decide=decide,
    build=build,
    summary="packed GDN calls at context parallel size > 1 keep each rank's tokens and every head: the conv's halo "
            "and the delta rule's state pass between ranks (no head all-to-all, heads need not divide cp); other "
            "calls are the route below",
    requires=needs_gdn_thd,
    opt_in=True,
)
