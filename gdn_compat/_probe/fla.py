"""fla (fla-core): which varlen entry points take what gdn_compat hands them, whether the code packed GDN reaches is
free of atomics, whether its chunk table is right for offsets with zero-length entries, and its Blackwell and
FlashQLA routing."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys
from typing import Any

from gdn_compat._probe.facts import Accepts, Varlen, _dist, _why, accepts, source


def _probe_fla(out: dict[str, Any]) -> None:
    out["fla"] = _dist("fla-core", "flash-linear-attention")
    try:
        rule = importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
        conv = importlib.import_module("fla.modules.convolution").causal_conv1d
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "fla":
            return
        out["fla_error"] = _why(exc)
    except Exception as exc:  # noqa: BLE001 - e.g. fla 0.4.x with Triton >= 3.7 raises ValueError
        out["fla_error"] = _why(exc)
    else:
        if out["fla"] is not None:
            out["fla"] = dataclasses.replace(out["fla"], path=getattr(sys.modules.get("fla"), "__file__", None))
        steps, out["notes"]["fla_state_steps"] = state_steps()
        out["fla_varlen"] = Varlen(rule=accepts(rule, "cu_seqlens"), rule_cpu=accepts(rule, "cu_seqlens_cpu"),
                                   conv=accepts(conv, "cu_seqlens"), conv_cpu=accepts(conv, "cu_seqlens_cpu"),
                                   rule_chunks=accepts(rule, "chunk_indices"), rule_inner=_inner_rule(),
                                   conv_chunks=accepts(conv, "chunk_indices"), state_steps=steps)
        out["fla_atomic_free"], out["notes"]["fla_atomic_free"] = atomic_free(rule, conv)
        out["fla_zero_length"], out["notes"]["fla_zero_length"] = zero_length()
        out["fla_blackwell_wy_guard"] = _blackwell_wy_guard()
        out["fla_flashqla_backend"] = _fla_flashqla_backend()
        out["fla_flashqla_off"] = os.environ.get("FLA_FLASH_QLA", "").strip() == "0"
        return
    unknown = Accepts.UNKNOWN
    out["fla_varlen"] = Varlen(unknown, unknown, unknown, unknown)
    out["notes"]["fla_varlen"] = f"fla failed to import ({out['fla_error']})"


# What to install: fla-core has the kernels megatron-core's GatedDeltaNet imports (flash-linear-attention is a meta
# package that adds models and transformers). Which release: the one made for the installed Triton (README,
# "Prerequisites"; the doctor's rules say which stacks crash).
FLA_FIX = ("pip install fla-core (or gdn-compat[fla]): fla-core 0.4.2 with torch <= 2.11 (Triton < 3.7), "
           "fla-core >= 0.5.1 with torch >= 2.13 (Triton >= 3.7.1)")


def fla_problem(facts: Any) -> str | None:
    """What keeps the installed fla from running GatedDeltaNet, with the fix (None: its varlen kernels are there).
    fla-core is what megatron-core's GDN imports its kernels from, and what gdn_compat's packed paths run, so every
    patch of a packed path says this before anything else it could say."""
    if facts.fla_error:
        return (f"{facts.fla or 'fla'} fails to import ({facts.fla_error}), so megatron-core's GatedDeltaNet cannot "
                f"be imported or built; install the fla-core release made for Triton {facts.triton} (fla-core 0.4.x "
                f"needs Triton < 3.7, newer Triton fla-core >= 0.5)")
    v = facts.fla_varlen
    if v.rule is Accepts.ABSENT and v.conv is Accepts.ABSENT:  # the probe found no fla package to import
        what = "fla-core is not installed" if facts.fla is None else f"{facts.fla} is installed, but not importable"
        return (f"{what}: megatron-core's GatedDeltaNet needs it (building one raises ImportError), and gdn_compat's "
                f"packed path runs its varlen kernels; {FLA_FIX}")
    if not v.usable:
        return (f"{facts.fla or 'fla'} lacks the varlen kernels packed GDN runs on (chunk_gated_delta_rule "
                f"cu_seqlens={v.rule}, causal_conv1d cu_seqlens={v.conv}); pip install 'fla-core>=0.4.2'")
    return None


# Offsets with zero-length entries, [0, 3, 3, 70, 70]: three sequences, the middle and last empty. Their 64-token
# chunks as (sequence, chunk): one of sequence 0, two of sequence 2.
ZERO_LENGTH_PACK, ZERO_LENGTH_CHUNKS = [0, 3, 3, 70, 70], [[0, 0], [2, 0], [2, 1]]


def zero_length(prepare: Any = None) -> tuple[Accepts, str]:
    """Whether fla's ``prepare_chunk_indices`` (what its varlen delta rule and Triton conv call when given only
    ``cu_seqlens``, as megatron 0.18/0.19 call them) numbers the chunks of offsets with zero-length entries right.
    It is plain torch, so it runs here on the CPU: fla-core 0.4.x and 0.5.0 number a chunk's sequence by counting
    the chunks that start one (``indices.eq(0).cumsum(0) - 1``), which skips empty sequences and hands every later
    chunk the offsets of the sequence before it: garbage or NaN, measured on an H200."""
    if prepare is None:
        try:
            prepare = importlib.import_module("fla.ops.utils.index").prepare_chunk_indices
        except Exception as exc:  # noqa: BLE001 - not found: unknown
            return Accepts.UNKNOWN, f"fla.ops.utils.index.prepare_chunk_indices not readable: {_why(exc)}"
    try:
        import torch

        got = prepare(torch.tensor(ZERO_LENGTH_PACK, dtype=torch.int64), 64).tolist()
    except Exception as exc:  # noqa: BLE001 - it failed on the CPU: unknown, not a crash
        return Accepts.UNKNOWN, f"prepare_chunk_indices failed on offsets {ZERO_LENGTH_PACK}: {_why(exc)}"
    if got == ZERO_LENGTH_CHUNKS:
        return Accepts.YES, f"prepare_chunk_indices({ZERO_LENGTH_PACK}, 64) = {got}, right"
    return Accepts.NO, (f"prepare_chunk_indices({ZERO_LENGTH_PACK}, 64) = {got}, expected {ZERO_LENGTH_CHUNKS}: "
                        f"chunks after a zero-length entry get another sequence's offsets")


# fla PR #1000 (for fla issue #999): on Blackwell, prepare_wy_repr_bwd's autotune space is cut to one config,
# because wider ones hang the backward at long sequences.
_WY_GUARD = re.compile(r"PREPARE_WY_REPR_BWD_NUM_\w+\s*=.*IS_NVIDIA_BLACKWELL")


def _blackwell_wy_guard() -> Accepts:
    try:
        text = source(importlib.import_module("fla.ops.gated_delta_rule.wy_fast"))
    except Exception:  # noqa: BLE001 - unreadable: unknown
        return Accepts.UNKNOWN
    return Accepts.YES if _WY_GUARD.search(text) else Accepts.NO


# What gdn_thd's _Rule passes to fla 0.4.x's own forward and backward, by keyword.
INNER_FWD = {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens", "chunk_indices"}
INNER_BWD = {"q", "k", "v", "g", "beta", "A", "scale", "initial_state", "do", "dht", "cu_seqlens", "chunk_indices"}


CHUNK_MODULE = "fla.ops.gated_delta_rule.chunk"  # fla's chunk forward / backward and the steps they call


def _inner_rule() -> Accepts:
    """fla's ``chunk_gated_delta_rule_fwd`` / ``_bwd`` take every argument gdn_thd's ``_Rule`` passes."""
    try:
        mod = importlib.import_module(CHUNK_MODULE)
        fwd, bwd = mod.chunk_gated_delta_rule_fwd, mod.chunk_gated_delta_rule_bwd
        ok = INNER_FWD <= set(inspect.signature(fwd).parameters) and INNER_BWD <= set(inspect.signature(bwd).parameters)
    except AttributeError:
        return Accepts.ABSENT
    except Exception:  # noqa: BLE001 - unreadable: not used
        return Accepts.UNKNOWN
    return Accepts.YES if ok else Accepts.NO


# gdn_cp_state's fla steps (gdn_thd/state_steps.py) call fla's chunk functions one by one, by keyword, in the order
# fla-core 0.4.2's chunk_gated_delta_rule_fwd / _bwd call them. The forward's exact parameters tell that order's
# release: 0.4.0/0.4.1 take no chunk_indices, 0.5.0 adds use_exp2 (gates in base 2), 0.5.2+ state_v_first and fused
# steps; those keep the one-pass path.
STATE_FWD = {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens", "cp_context",
             "chunk_indices", "transpose_state_layout"}
_AT = {"cu_seqlens", "chunk_indices"}
STATE_STEPS = {
    "chunk_local_cumsum": {"g", "chunk_size", "reverse"} | _AT,
    "chunk_scaled_dot_kkt_fwd": {"k", "g", "beta", "output_dtype"} | _AT,
    "solve_tril": {"A", "output_dtype"} | _AT,
    "recompute_w_u_fwd": {"k", "v", "beta", "A", "g"} | _AT,
    "chunk_gated_delta_rule_fwd_h": {"k", "w", "u", "g", "initial_state", "output_final_state", "save_new_value"} | _AT,
    "chunk_fwd_o": {"q", "k", "v", "h", "g", "scale"} | _AT,
    "chunk_bwd_dv_local": {"q", "k", "g", "do", "scale"} | _AT,
    "chunk_gated_delta_rule_bwd_dhu": {"q", "k", "w", "g", "h0", "dht", "do", "dv", "scale"} | _AT,
    "chunk_bwd_dqkwg": {"q", "k", "v", "w", "g", "h", "dv", "do", "dh", "scale"} | _AT,
    "prepare_wy_repr_bwd": {"k", "v", "beta", "g", "A", "dw", "du"} | _AT,
}


def state_steps(module: Any = None) -> tuple[Accepts, str]:
    """Whether fla's chunk module (``module``; default the installed ``fla.ops.gated_delta_rule.chunk``) has the
    steps gdn_cp_state's fla path calls, in fla-core 0.4.2's shape: its forward's parameters exactly 0.4.2's, and
    every step by that name taking the keywords passed to it."""
    try:
        module = module or importlib.import_module(CHUNK_MODULE)
        fwd = set(inspect.signature(module.chunk_gated_delta_rule_fwd).parameters)
        if fwd != STATE_FWD:
            return Accepts.NO, (f"its chunk_gated_delta_rule_fwd is not fla-core 0.4.2's (parameters added: "
                                f"{sorted(fwd - STATE_FWD) or 'none'}, missing: {sorted(STATE_FWD - fwd) or 'none'})")
        for name, keywords in STATE_STEPS.items():
            step = getattr(module, name, None)
            missing = sorted(keywords - set(inspect.signature(step).parameters)) if step is not None else ["itself"]
            if missing:
                return Accepts.NO, f"its {name} lacks {', '.join(missing)}"
    except AttributeError as exc:
        return Accepts.ABSENT, f"no chunk forward ({exc})"
    except Exception as exc:  # noqa: BLE001 - unreadable: not used
        return Accepts.UNKNOWN, _why(exc)
    return Accepts.YES, "fla-core 0.4.2's chunk steps: the forward's parameters and every step's keywords"


# Order-dependent accumulation: Triton atomics, and torch's accumulating index ops (atomics on CUDA).
_ATOMIC = re.compile(r"\b(?:tl\.atomic_\w+|atomic_add|atomic_max|atomic_min|atomic_xchg|atomic_cas|index_add_?|"
                     r"scatter_add_?|scatter_reduce_?|index_reduce_?|index_put_?)\b")


def _fla_module_of(obj: Any, prefix: str, depth: int = 0) -> str | None:
    """The fla module that defines ``obj`` (a Triton Autotuner/Heuristics is unwrapped to its ``fn``)."""
    name = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
    if isinstance(name, str) and (name == prefix or name.startswith(prefix + ".")):
        return name
    if not inspect.ismodule(obj) and depth < 4 and hasattr(obj, "fn"):
        return _fla_module_of(obj.fn, prefix, depth + 1)
    return None


def atomic_free(*entry_points: Any, prefix: str = "fla") -> tuple[Accepts, str]:
    """Whether the code that ``entry_points`` reach (their modules, and every ``prefix`` module those
    name, transitively) is free of atomics and accumulating scatters: with none, a Triton kernel at a
    fixed launch configuration sums in a fixed order, so its results repeat bit for bit."""
    roots = [_fla_module_of(f, prefix) for f in entry_points]
    todo, seen, hits = [r for r in roots if r], set(), []
    if not todo:
        return Accepts.UNKNOWN, "entry points not found in fla"
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        module = sys.modules.get(name)
        if module is None:
            continue
        try:
            found = sorted(set(_ATOMIC.findall(source(module))))
        except (OSError, TypeError):  # a package without source: nothing proves it atomic-free
            return Accepts.UNKNOWN, f"source of {name} not readable"
        if found:
            hits.append(f"{name} ({', '.join(found)})")
        todo += [m for m in (_fla_module_of(v, prefix) for v in list(vars(module).values())) if m and m not in seen]
    if hits:
        return Accepts.NO, f"{len(seen)} modules read; atomics or scatter-adds in " + "; ".join(hits)
    return Accepts.YES, f"{len(seen)} modules read, none has atomics or scatter-adds"


def _fla_flashqla_backend() -> Accepts:
    """fla >= 0.5.2 dispatches chunk_gated_delta_rule to FlashQLA whenever flash_qla imports (fla #998)."""
    import importlib.util

    try:
        return Accepts.YES if importlib.util.find_spec("fla.ops.gated_delta_rule.backends.flash_qla") else Accepts.NO
    except Exception:  # noqa: BLE001 - no such package: no such backend
        return Accepts.NO
