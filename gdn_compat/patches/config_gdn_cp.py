"""config_gdn_cp: let ``TransformerConfig`` ask for context parallelism with GDN on 0.16.x/0.17.x.

Their ``TransformerConfig.__post_init__`` asserts ``context_parallel_size == 1`` whenever
``experimental_attention_variant == 'gated_delta_net'`` ("Gated delta net does not support context
parallel for now"), so the CP that ``gdn_thd`` gives GatedDeltaNet cannot be configured
(Megatron-Bridge issue #4327). Upstream dropped the assertion when GDN gained CP (PR #2645, 0.18.0).

The replacement is the release's own ``__post_init__`` recompiled from its source with exactly that
one ``assert`` removed: every other check runs unchanged, in order, with its line numbers. Applied
only together with ``gdn_thd`` (``requires``); without it the assertion stays, because GDN on these
releases would then silently treat each rank's shard as a whole sequence.
"""

from __future__ import annotations

import ast
import inspect
import sys
from typing import Any

from gdn_compat._probe import CONFIG_MODULE, Facts
from gdn_compat._probe.config import _gdn_cp_asserts, _parse
from gdn_compat._registry import Patch, Target

LIFTED = "assert self.context_parallel_size == 1  (under experimental_attention_variant == 'gated_delta_net')"


def decide(facts: Facts) -> str | None:
    if facts.megatron is None:
        return "megatron-core is not installed"
    if not facts.config_refuses_gdn_cp:
        why = facts.notes.get("config_refuses_gdn_cp")
        return why or f"{facts.release} TransformerConfig does not refuse context parallelism for gated_delta_net"
    return None


def build(facts: Facts, original: Any) -> Any:
    """The release's ``__post_init__`` without the one assertion, compiled in the release module."""
    tree, func = _parse(original)
    [(body, stmt)] = _gdn_cp_asserts(func)
    body[body.index(stmt)] = ast.copy_location(ast.Pass(), stmt)
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
    namespace: dict[str, Any] = {}
    exec(compile(module, inspect.getsourcefile(original) or "<release>", "exec"),  # noqa: S102
         sys.modules[original.__module__].__dict__, namespace)
    owner = sys.modules[original.__module__].TransformerConfig
    replacement = namespace["_gdn_compat_factory"](owner)
    replacement.__qualname__, replacement.__doc__ = original.__qualname__, original.__doc__
    replacement.__wrapped__ = original
    return replacement


PATCH = Patch(
    name="config_gdn_cp",
    target=Target(CONFIG_MODULE, "TransformerConfig", "__post_init__"),
    decide=decide,
    build=build,
    summary=f"TransformerConfig.__post_init__ without the one check `{LIFTED}`, because gdn_thd gives "
            f"GatedDeltaNet context parallelism (as upstream 0.18, PR #2645); every other check unchanged",
    requires=("gdn_thd",),
)
