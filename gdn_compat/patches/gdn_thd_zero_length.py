"""gdn_thd_zero_length: packed offsets with zero-length entries on megatron-core 0.18.x/0.19.x, where the installed
fla numbers their chunks wrong.

Offsets with repeated values are ordinary: a fixed-count ``cu_seqlens`` for CUDA graphs or a static-shape packer, an
empty sample in an RL batch. The native THD forward of 0.18/0.19 hands fla only ``cu_seqlens``, and fla builds the
chunk table of its varlen delta rule and Triton conv with ``prepare_chunk_indices``, which in fla-core 0.4.x and
0.5.0 counts a chunk's sequence by the chunks that start one: every chunk after an empty entry gets the offsets of
the sequence before it. Measured on an H200 (torch 2.11, fla-core 0.4.2, pack ``[0, 100, 0, 0, 257, 1, 0, 640,
0]``): the conv off by up to 3.69 with no NaN, the delta rule NaN; a Qwen3-Next layer on 0.19.2 all NaN, or finite
and wrong (relative error 0.95, gradients ~1e32) depending on what the memory held.

The probe runs the installed fla's ``prepare_chunk_indices`` on a small pack with empty entries on the CPU (it is
plain torch; ``Facts.fla_zero_length``); only where it is wrong does this patch apply. The replacement wraps the
release's forward and takes exactly the packed calls whose offsets hold an empty entry: gdn_thd's packed path (the
same projections, kernels, norm and context-parallel exchange) with the empty entries dropped from the offsets fla
sees (a host pack; the release reads the offsets on the host in every call too), or, for a graph-safe pack (CUDA
graph capture, a ``PackBuffer``), the pack's own chunk table, which numbers sequences right. Every other call,
every pack without an empty entry included, is the release's own forward. 0.16/0.17: gdn_thd drops empty entries
itself.
"""

from __future__ import annotations

from typing import Any

from gdn_compat._probe import GDN_MODULE, Accepts, Facts
from gdn_compat._registry import Patch, Target
from gdn_compat.patches.gdn_thd import carrier_skip, route

REFUSAL = ("gdn_compat: these packed offsets hold zero-length entries, which {fla}'s kernels mishandle in the "
           "release's own forward (its chunk table numbers sequences wrong: garbage or NaN), and gdn_compat's packed "
           "path cannot take this layer: {{why}}. Drop the zero-length entries from cu_seqlens before the model sees "
           "them, or use fla-core >= 0.5.1")


def decide(facts: Facts) -> str | None:
    skip = carrier_skip(facts, "gdn_thd drops zero-length entries from the offsets it hands fla there")
    if skip:
        return skip
    if facts.fla_zero_length is Accepts.YES:
        return (f"{facts.release} with {facts.fla}: fla numbers the chunks of offsets with zero-length entries right "
                f"({facts.notes['fla_zero_length']})")
    if facts.fla_zero_length is not Accepts.NO:
        return f"not patched: {facts.notes.get('fla_zero_length', 'fla chunk indices not probed')}"
    return None


def build(facts: Facts, original: Any) -> Any:
    return route(facts, original, lambda layer: True, wants=lambda layer, pack: pack.empty_entries,
                 must=REFUSAL.format(fla=facts.fla or "fla"))


PATCH = Patch(
    name="gdn_thd_zero_length",
    target=Target(GDN_MODULE, "GatedDeltaNet", "forward"),
    decide=decide,
    build=build,
    summary="packed GDN calls whose offsets hold zero-length entries run gdn_compat's packed path (empty entries "
            "dropped, or a right chunk table), where the installed fla's prepare_chunk_indices numbers them wrong; "
            "every other call is the release's",
)
