"""gdn_cp_comm_type: ``GatedDeltaNet.__init__`` accepts ``cp_comm_type`` on 0.16.x-0.18.x.

With ``context_parallel_size > 1`` and ``cp_comm_type`` set (Megatron's training arguments default
it to ``p2p``), ``TransformerLayer`` passes ``cp_comm_type=`` to its attention module, and these
releases' GatedDeltaNet raises ``TypeError: __init__() got an unexpected keyword argument
'cp_comm_type'`` (ModelScope mcore-bridge issue #48). 0.19.0 added the parameter (upstream #5843)
and ignores it: GDN's context parallelism is its own all-to-all, not one of attention's CP
communication schemes. The replacement does the same: it accepts the keyword, drops it, and calls
the release's ``__init__`` with everything else.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from gdn_compat._probe import GDN_MODULE, Accepts, Facts, Layout, fla_problem
from gdn_compat._registry import Patch, Target


def decide(facts: Facts) -> str | None:
    if facts.gdn is Layout.ABSENT:
        return f"{facts.release} has no GatedDeltaNet"
    if facts.gdn is Layout.UNKNOWN and fla_problem(facts):  # a broken fla breaks the import of megatron's GDN
        return f"not patched: {fla_problem(facts)}"
    if facts.gdn_init_cp_comm_type is Accepts.YES:
        return f"{facts.release} GatedDeltaNet.__init__ already accepts cp_comm_type (upstream #5843)"
    if facts.gdn_init_cp_comm_type is not Accepts.NO:
        return f"not patched: GatedDeltaNet.__init__ signature is {facts.gdn_init_cp_comm_type}"
    return None


def build(facts: Facts, original: Any) -> Any:
    sig = inspect.signature(original)
    params = list(sig.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    params.insert(at, inspect.Parameter("cp_comm_type", inspect.Parameter.KEYWORD_ONLY, default=None))

    @functools.wraps(original)
    def __init__(self, *args, cp_comm_type=None, **kwargs):
        # Accepted for TransformerLayer and ignored, as upstream 0.19 does (#5843).
        original(self, *args, **kwargs)

    __init__.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return __init__


PATCH = Patch(
    name="gdn_cp_comm_type",
    target=Target(GDN_MODULE, "GatedDeltaNet", "__init__"),
    decide=decide,
    build=build,
    summary="GatedDeltaNet.__init__ accepts cp_comm_type and ignores it (GDN's context parallelism is its "
            "own all-to-all), as upstream 0.19 does (#5843)",
)
