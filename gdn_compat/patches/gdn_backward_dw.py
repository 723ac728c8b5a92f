"""gdn_backward_dw: ``GatedDeltaNet.backward_dw`` on megatron-core 0.16.x.

With MoE expert-parallel communication overlap (``overlap_moe_expert_parallel_comm``), every
``TransformerLayer`` builds a ``_BackwardDWWrapper`` (``models/gpt/fine_grained_callables.py``) that reads
``layer.self_attention.backward_dw`` for the delayed weight-gradient pass. 0.16.x's GatedDeltaNet has
no such method, so a GDN hybrid with that option dies at construction with ``AttributeError:
'GatedDeltaNet' object has no attribute 'backward_dw'``; upstream added it in 0.17.0 (#2997).

The added method does what 0.17's does: the input projection's ``backward_dw``, then the output
projection's. A Transformer Engine linear computes its delayed weight gradient there. megatron's local
``ColumnParallelLinear`` / ``RowParallelLinear`` never delay it (their backward computes it; 0.16.1's
local ``RowParallelLinear`` lacks the method, which 0.17 added as a documented no-op), so for them there
is nothing left to do. Any other linear without ``backward_dw`` is an error naming its class: gdn_compat
cannot tell whether it deferred a gradient, and silence could lose one.
"""

from __future__ import annotations

from typing import Any

from gdn_compat._probe import GDN_MODULE, Accepts, Facts, Layout, fla_problem
from gdn_compat._registry import Patch, Target


def decide(facts: Facts) -> str | None:
    mc = facts.release
    if facts.gdn is Layout.ABSENT:
        return f"{mc} has no GatedDeltaNet"
    if facts.gdn is Layout.UNKNOWN and fla_problem(facts):  # a broken fla breaks the import of megatron's GDN
        return f"not patched: {fla_problem(facts)}"
    if facts.gdn_backward_dw is Accepts.YES:
        where = facts.notes.get("gdn_backward_dw", "")
        if where.startswith("the release's own"):
            return f"{mc} GatedDeltaNet already has backward_dw (upstream #2997, 0.17.0)"
        return f"{mc} GatedDeltaNet already has a backward_dw: {where or 'not its own'}; not patched"
    if facts.gdn_backward_dw is not Accepts.NO:
        return f"not patched: GatedDeltaNet not readable ({facts.notes.get('gdn', facts.gdn)})"
    return None


def _local_linear(module: Any) -> bool:
    from megatron.core.tensor_parallel import layers

    return isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear))


def _backward_dw_of(layer: Any, name: str) -> None:
    linear = getattr(layer, name)
    method = getattr(linear, "backward_dw", None)
    if callable(method):
        method()
    elif not _local_linear(linear):
        raise AttributeError(f"gdn_compat gdn_backward_dw: GatedDeltaNet.{name} is a {type(linear).__qualname__} "
                             f"without backward_dw; cannot tell whether its weight gradient was deferred")


def backward_dw(self) -> None:
    """Execute weight gradient computation for all linear layers (as 0.17's, upstream #2997)."""
    _backward_dw_of(self, "in_proj")
    _backward_dw_of(self, "out_proj")


class AddedMethod:
    """``GatedDeltaNet.backward_dw`` as a descriptor that never shadows a ``backward_dw`` from elsewhere in an
    instance's MRO: Python reaches it only when no class before GatedDeltaNet defines one; it then returns the
    first definition after GatedDeltaNet (``class MyGDN(GatedDeltaNet, Mixin)`` keeps ``Mixin.backward_dw``),
    and the added method only where there is none."""

    def __init__(self, owner: type, func: Any):
        self.owner, self.func = owner, func
        self.__doc__, self.__wrapped__ = func.__doc__, func

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        cls = objtype if objtype is not None else type(obj)
        mro = cls.__mro__
        later = mro[mro.index(self.owner) + 1:] if self.owner in mro else ()
        found = next((c.__dict__["backward_dw"] for c in later if "backward_dw" in c.__dict__), None)
        target = self.func if found is None else found
        return target if obj is None else target.__get__(obj, cls)


def build(facts: Facts, original: Any) -> Any:
    import importlib

    return AddedMethod(importlib.import_module(GDN_MODULE).GatedDeltaNet, backward_dw)


PATCH = Patch(
    name="gdn_backward_dw",
    target=Target(GDN_MODULE, "GatedDeltaNet", "backward_dw"),
    decide=decide,
    build=build,
    summary="adds GatedDeltaNet.backward_dw (in_proj then out_proj, as 0.17's, upstream #2997) for MoE expert-parallel "
            "overlap's delayed weight gradients; megatron's local linears have none to delay",
    adds=True,
)
