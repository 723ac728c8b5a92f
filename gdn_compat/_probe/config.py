"""TransformerConfig and finalize_model_grads: whether the config refuses context parallelism for GDN (0.16/0.17), or
asserts that GDN's heads divide tp x cp (0.18/0.19), read from ``__post_init__``'s source, whose AST ``config_gdn_cp``
also rewrites; and whether the release sums GDN's out_norm gradient over tensor parallelism."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import textwrap
from typing import Any

from gdn_compat._probe.facts import CONFIG_MODULE, FINALIZE_MODULE, Accepts, _why, source


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr
            and isinstance(node.value, ast.Name) and node.value.id == "self")


def _compares(node: ast.AST, attr: str, value: object) -> bool:
    """``self.<attr> == <value>``."""
    return (isinstance(node, ast.Compare) and _is_self_attr(node.left, attr) and len(node.ops) == 1
            and isinstance(node.ops[0], ast.Eq) and isinstance(node.comparators[0], ast.Constant)
            and node.comparators[0].value == value)


def _gdn_cp_asserts(func: ast.FunctionDef) -> list[tuple[list[ast.stmt], ast.Assert]]:
    """Every ``assert self.context_parallel_size == 1`` directly inside an
    ``if self.experimental_attention_variant == "gated_delta_net":`` block, with its block."""
    found = []
    for node in ast.walk(func):
        if isinstance(node, ast.If) and _compares(node.test, "experimental_attention_variant", "gated_delta_net"):
            found += [(node.body, stmt) for stmt in node.body
                      if isinstance(stmt, ast.Assert) and _compares(stmt.test, "context_parallel_size", 1)]
    return found


def _is_tp_times_cp(node: ast.AST) -> bool:
    """``self.tensor_model_parallel_size * self.context_parallel_size``."""
    return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)
            and _is_self_attr(node.left, "tensor_model_parallel_size")
            and _is_self_attr(node.right, "context_parallel_size"))


def _gdn_heads_cp_asserts(func: ast.FunctionDef) -> list[tuple[list[ast.stmt], ast.Assert, str]]:
    """0.18/0.19: every ``assert self.linear_num_<kind>_heads % <tp x cp> == 0`` directly inside the
    ``gated_delta_net`` block, ``<tp x cp>`` a name that block assigns ``tp * cp`` (or the product itself), with its
    block and the heads attribute."""
    found = []
    for node in ast.walk(func):
        if not (isinstance(node, ast.If) and _compares(node.test, "experimental_attention_variant", "gated_delta_net")):
            continue
        products = {t.id for stmt in node.body if isinstance(stmt, ast.Assign) and _is_tp_times_cp(stmt.value)
                    for t in stmt.targets if isinstance(t, ast.Name)}
        for stmt in node.body:
            if not isinstance(stmt, ast.Assert):
                continue
            test = stmt.test
            if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
                    and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == 0
                    and isinstance(test.left, ast.BinOp) and isinstance(test.left.op, ast.Mod)):
                continue
            heads, by = test.left.left, test.left.right
            if (isinstance(heads, ast.Attribute) and heads.attr in ("linear_num_key_heads", "linear_num_value_heads")
                    and _is_self_attr(heads, heads.attr)
                    and ((isinstance(by, ast.Name) and by.id in products) or _is_tp_times_cp(by))):
                found.append((node.body, stmt, heads.attr))
    return found


def _parse(func: Any) -> tuple[ast.Module, ast.FunctionDef]:
    """The function's own AST with the release's positions: lines as in its file (set by ``build``), and
    columns shifted back by the indentation ``dedent`` removed, so traceback carets point where they did."""
    text = source(func)
    dedented = textwrap.dedent(text)
    indent = len(text) - len(text.lstrip()) - (len(dedented) - len(dedented.lstrip()))
    tree = ast.parse(dedented)
    for node in ast.walk(tree):
        for field in ("col_offset", "end_col_offset"):
            if getattr(node, field, None) is not None:
                setattr(node, field, getattr(node, field) + indent)
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        raise TypeError(f"{func.__qualname__} is not a plain function")
    return tree, node


@functools.lru_cache(maxsize=16)
def _gdn_checks(post_init: Any) -> tuple[int, tuple[str, ...]]:
    """How many ``cp == 1`` assertions ``__post_init__`` holds for GDN, and which heads it asserts divide tp x cp:
    parsed once per function object (every ``apply()`` and ``plan()`` asks; a replaced ``__post_init__`` is another
    object). Raises what ``_parse`` raises when the source cannot be read."""
    _, node = _parse(post_init)
    return len(_gdn_cp_asserts(node)), tuple(sorted(attr for _, _, attr in _gdn_heads_cp_asserts(node)))


def refuses_gdn_cp(config_cls: Any) -> bool:
    """The probe: ``__post_init__`` holds exactly one such assertion (read from the release source)."""
    try:
        return _gdn_checks(config_cls.__post_init__)[0] == 1
    except (TypeError, OSError, SyntaxError, IndexError):
        return False


def heads_divide_tp_cp(config_cls: Any) -> bool:
    """The probe of 0.18/0.19: ``__post_init__`` asserts that GDN's key heads and its value heads (one assertion
    each) divide tensor x context parallel size (read from the release source)."""
    try:
        return _gdn_checks(config_cls.__post_init__)[1] == ("linear_num_key_heads", "linear_num_value_heads")
    except (TypeError, OSError, SyntaxError, IndexError):
        return False


def _probe_config(out: dict[str, Any]) -> None:
    try:
        config = importlib.import_module(CONFIG_MODULE).TransformerConfig
    except Exception as exc:  # noqa: BLE001
        out["notes"]["config_refuses_gdn_cp"] = f"not read: importing {CONFIG_MODULE} failed: {_why(exc)}"
        out["notes"]["config_gdn_heads_divide_cp"] = out["notes"]["config_refuses_gdn_cp"]
        return
    out["config_refuses_gdn_cp"] = refuses_gdn_cp(config)
    out["config_gdn_heads_divide_cp"] = heads_divide_tp_cp(config)


_SELECTS_SP = re.compile(r"config\.sequence_parallel\s+and\s+getattr\(\s*param,\s*[\"']sequence_parallel")


def _probe_finalize(out: dict[str, Any]) -> None:
    """Does the release's TP reduction of replicated grads already cover GDN's out_norm?"""
    try:
        mod = importlib.import_module(FINALIZE_MODULE)
        src = source(mod.__dict__["_allreduce_non_tensor_model_parallel_grads"])
    except Exception as exc:  # noqa: BLE001
        out["gdn_out_norm_tp_sum"] = Accepts.UNKNOWN
        out["notes"]["gdn_out_norm_tp_sum"] = f"cannot read {FINALIZE_MODULE}: {_why(exc)}"
        return
    if "out_norm" in src or "GatedDeltaNet" in src or "gated_delta" in src:
        out["gdn_out_norm_tp_sum"] = Accepts.YES
    elif _SELECTS_SP.search(src):
        out["gdn_out_norm_tp_sum"] = Accepts.NO
    else:
        out["gdn_out_norm_tp_sum"] = Accepts.UNKNOWN
        out["notes"]["gdn_out_norm_tp_sum"] = "_allreduce_non_tensor_model_parallel_grads selects grads in an unknown way"
