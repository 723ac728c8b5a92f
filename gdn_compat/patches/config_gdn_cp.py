"""config_gdn_cp: let ``TransformerConfig`` ask for the context parallelism gdn_compat gives GDN.

- 0.16.x/0.17.x: their ``TransformerConfig.__post_init__`` asserts ``context_parallel_size == 1`` whenever
  ``experimental_attention_variant == 'gated_delta_net'`` ("Gated delta net does not support context parallel for
  now"), so the CP that ``gdn_thd`` gives GatedDeltaNet cannot be configured (Megatron-Bridge issue #4327). Upstream
  dropped the assertion when GDN gained CP (PR #2645, 0.18.0). Applied only together with ``gdn_thd``; without it the
  assertion stays, because GDN on these releases would then silently treat each rank's shard as a whole sequence.
- 0.18.x/0.19.x: their ``__post_init__`` asserts that GDN's key heads and its value heads divide
  ``tensor_model_parallel_size * context_parallel_size`` (the head all-to-all of their CP). With ``gdn_cp_state``
  (#56) packed calls keep every head of the tensor-parallel rank, so the two assertions check
  ``tensor_model_parallel_size`` alone. Applied only together with ``gdn_cp_state``; a call that would still split
  heads across cp ranks with heads that do not divide (an unpacked call, a graph-safe pack) is refused by
  ``gdn_cp_state`` with the numbers, never run.

The replacement is the release's own ``__post_init__`` recompiled from its source with exactly that one
``assert`` removed (or those two narrowed): every other check runs unchanged, in order, with its line numbers.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import types
from typing import Any

from gdn_compat._probe import CONFIG_MODULE, Facts
from gdn_compat._probe.config import _gdn_cp_asserts, _gdn_heads_cp_asserts, _parse
from gdn_compat._registry import Patch, Target

LIFTED = "assert self.context_parallel_size == 1  (under experimental_attention_variant == 'gated_delta_net')"
NARROWED = "assert linear_num_{key,value}_heads % (tp x cp) == 0, now % tp"


def decide(facts: Facts) -> str | None:
    if facts.megatron is None:
        return "megatron-core is not installed"
    if not facts.config_refuses_gdn_cp and not facts.config_gdn_heads_divide_cp:
        why = facts.notes.get("config_refuses_gdn_cp")
        return why or (f"{facts.release} TransformerConfig neither refuses context parallelism for gated_delta_net "
                       f"nor asserts that its heads divide tp x cp")
    return None


def requires(facts: Facts) -> tuple[str, ...]:
    """What gives GDN the context parallelism the config then accepts."""
    if facts.config_refuses_gdn_cp:
        return ("gdn_thd",)
    return ("gdn_cp_state",) if facts.config_gdn_heads_divide_cp else ()


def summary(facts: Facts) -> str:
    if facts.config_refuses_gdn_cp:
        return (f"TransformerConfig.__post_init__ without the one check `{LIFTED}`, because gdn_thd gives "
                f"GatedDeltaNet context parallelism (as upstream 0.18, PR #2645); every other check unchanged")
    return (f"TransformerConfig.__post_init__ with the two checks `{NARROWED}`, because gdn_cp_state passes the "
            f"state between context-parallel ranks with every head; every other check unchanged")


def _narrowed(stmt: ast.Assert, heads: str) -> ast.Assert:
    """``assert self.<heads> % self.tensor_model_parallel_size == 0, <what and why>`` at ``stmt``'s position."""
    new = ast.parse(
        f"assert self.{heads} % self.tensor_model_parallel_size == 0, (f'{{self.{heads}=}} must be a multiple of "
        f"{{self.tensor_model_parallel_size=}} (gdn_compat gdn_cp_state: context parallelism passes the state, "
        f"so the heads need not divide context_parallel_size)')").body[0]
    assert isinstance(new, ast.Assert)
    for node in ast.walk(new):  # the release's line (and column) for every node: tracebacks point at its assert
        ast.copy_location(node, stmt)
    return new


def build(facts: Facts, original: Any) -> Any:
    """The release's ``__post_init__`` without the one assertion (0.16/0.17), or with the two narrowed to tp
    (0.18/0.19), compiled in the release module."""
    namespace: dict[str, Any] = {}
    exec(_rewritten(original, facts.config_refuses_gdn_cp), sys.modules[original.__module__].__dict__,  # noqa: S102
         namespace)
    owner = sys.modules[original.__module__].TransformerConfig
    replacement = namespace["_gdn_compat_factory"](owner)
    replacement.__qualname__, replacement.__doc__ = original.__qualname__, original.__doc__
    replacement.__wrapped__ = original
    return replacement


@functools.lru_cache(maxsize=8)
def _rewritten(original: Any, lift: bool) -> types.CodeType:
    """The rewritten ``__post_init__``'s module code (a factory that returns it), compiled once per original: every
    ``apply()`` runs ``build`` again, and the release's ``__post_init__`` is some thousand lines to parse."""
    tree, func = _parse(original)
    if lift:
        [(body, stmt)] = _gdn_cp_asserts(func)
        body[body.index(stmt)] = ast.copy_location(ast.Pass(), stmt)
    else:
        for body, stmt, heads in _gdn_heads_cp_asserts(func):
            body[body.index(stmt)] = _narrowed(stmt, heads)
    func.decorator_list = []
    # Zero-argument super() needs a __class__ cell: compile inside a factory that provides one.
    factory = ast.FunctionDef(
        name="_gdn_compat_factory", args=ast.arguments(posonlyargs=[], args=[ast.arg("__class__")], kwonlyargs=[],
                                                       kw_defaults=[], defaults=[]),
        body=[func, ast.Return(ast.Name(func.name, ast.Load()))], decorator_list=[], returns=None, type_params=[],
    )
    module = ast.Module(body=[factory], type_ignores=[])
    ast.fix_missing_locations(module)
    ast.increment_lineno(module, inspect.getsourcelines(original)[1] - 1)  # the release's line numbers
    return compile(module, inspect.getsourcefile(original) or "<release>", "exec")


PATCH = Patch(
    name="config_gdn_cp",
    target=Target(CONFIG_MODULE, "TransformerConfig", "__post_init__"),
    decide=decide,
    build=build,
    summary=summary,
    requires=requires,
)
