"""gdn_thd: packed sequences (``qkv_format='thd'``) for GatedDeltaNet on megatron-core 0.16.x/0.17.x.

Those releases raise ``NotImplementedError`` for any ``packed_seq_params``. Upstream added THD in
NVIDIA/Megatron-LM PR #2645 (released in 0.18.0); this replacement gives 0.16/0.17 the same
contract and, on CUDA, runs the same fla kernels in the same order as 0.18/0.19's native path:

* not packed (``None``, ``'bshd'``, ``'sbhd'``, ...) at cp = 1: the release's own forward, with
  ``packed_seq_params=None``;
* packed: boundaries from the pack (``pack.py``), the core over the whole pack (``kernels.py``:
  fla's varlen kernels on CUDA, also in ``deterministic_mode`` (which upstream refuses for THD) when
  they are atomic-free; pure torch on the CPU);
* context parallel, packed or not (these releases have none and with cp > 1 silently treat each
  rank's shard as a whole sequence): one all-to-all each way (``context_parallel.py``).

This file holds the decision and the wiring.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from gdn_compat._probe import GDN_MODULE, Cp, Facts, Layout, Thd, fla_problem
from gdn_compat._registry import MARKER, Patch, Target
from gdn_compat.patches.gdn_thd import context_parallel as cpx
from gdn_compat.patches.gdn_thd import fast
from gdn_compat.patches.gdn_thd.fast import Fast
from gdn_compat.patches.gdn_thd.kernels import UNFUSED_OWN, Core, local_view
from gdn_compat.patches.gdn_thd.pack import PACKS, Pack, pack_for, rows_pack

__all__ = ["PACKS", "PATCH", "carrier_skip", "fast_below", "needs_gdn_thd", "pack_of", "packed_forward", "route", "route_skip"]


def decide(facts: Facts) -> str | None:
    mc = facts.release
    if facts.gdn is Layout.ABSENT:
        return f"{mc} has no GatedDeltaNet"
    if facts.gdn_thd is not Thd.NATIVE and fla_problem(facts):  # said first: without fla the GDN shape reads as unknown
        return f"not patched: {fla_problem(facts)}"
    if facts.gdn is Layout.UNKNOWN:
        return f"not patched: {facts.notes.get('gdn', 'GatedDeltaNet not readable')}"
    if facts.gdn_thd is Thd.NATIVE:
        return f"{mc} GatedDeltaNet.forward already handles qkv_format='thd' (upstream PR #2645)"
    if facts.gdn_thd is not Thd.REFUSES:
        return f"not patched, unknown GatedDeltaNet shape: {facts.notes.get('gdn_thd', facts.gdn_thd)}"
    if not facts.gdn_legacy_shape:
        return ("not patched, unknown GatedDeltaNet shape: forward refuses THD but its signature or "
                "helpers (_apply_gated_norm, l2norm, torch_chunk_gated_delta_rule) differ from 0.16/0.17")
    if facts.gdn_cp is Cp.NATIVE:
        return "not patched, unknown GatedDeltaNet shape: refuses THD yet has context parallelism"
    return None


def packed_forward(layer: Any, core: Core, hidden_states: torch.Tensor, pack: Pack, cp: int) -> tuple[torch.Tensor, Any]:
    """The GDN over [s_local, b, h] input whose rows are ``pack``'s sequences (b = 1 for THD)."""
    group = cpx.group_of(layer)
    passing = cp > 1 and core.passes_state(pack)  # gdn_cp_state: this rank's tokens, every head, the state crosses
    loc = local_view(layer, 1, 0) if passing else local_view(layer, cp, group.rank() if cp > 1 else 0)
    qkvzba, _ = layer.in_proj(hidden_states)  # gathers the sequence-parallel shards
    if cp > 1 and not passing:
        assert pack.perm is not None and pack.inverse is not None
        tp_hv = layer.num_value_heads // layer.tp_size
        sections = [layer.qk_dim // layer.tp_size] * 2 + [layer.v_dim // layer.tp_size] * 2 + [tp_hv, tp_hv]
        qkvzba = cpx.cp2hp(qkvzba, sections, pack.perm, group, cp)  # all tokens, this rank's heads
    seq, rows = qkvzba.shape[0], qkvzba.shape[1]
    total = seq * rows
    hv = loc.v // loc.dv  # shapes spelled out: a -1 is ambiguous for an empty pack
    qkvzba = qkvzba.transpose(0, 1).reshape(1, total, 2 * loc.qk + 2 * loc.v + 2 * hv)
    # The fused region takes [T, F] as a view (reshape), not qkvzba[0]: a select's backward allocates a zeroed
    # [1, T, F] and copies the gradient into it (a fill and a copy of the whole in_proj output every step).
    flat = qkvzba.reshape(total, qkvzba.shape[-1])

    def finish(norm_out: torch.Tensor) -> torch.Tensor:  # -> the output projection's input
        norm_out = norm_out.reshape(rows, seq, loc.v).transpose(0, 1).contiguous()  # no -1: 0 tokens
        return norm_out if pack.inverse is None or passing else cpx.hp2cp(norm_out, pack.inverse, group, cp)

    checkpoint = None
    region: Any
    why: str | None
    if passing and core.fast.fused:
        region, why = None, "context parallelism that passes the state (gdn_cp_state) runs the unfused region"
    else:
        region, why = core.region_core(layer, loc, flat, pack) if total and core.fast.fused else (None, "off")
    if region is not None:  # gdn_fused: the whole region in gdn_compat's kernels (it keeps no norm output)
        norm_out = finish(core.region(layer, loc, flat, pack, region))
    else:
        if why != "off":
            fast.note("gdn_fused", str(why))
        qkv, gate, beta, alpha = torch.split(qkvzba, [2 * loc.qk + loc.v, loc.v, hv, hv], dim=-1)
        gate = gate.reshape(1, total, hv, loc.dv)
        beta = beta.reshape(1, total, hv)
        alpha = alpha.reshape(1, total, hv)
        if passing:  # an empty local share still joins its ranks' collectives
            out, gate = core.state_passing(layer, loc, qkv, gate, beta, alpha, pack, group)
        elif total:
            out, gate = core(layer, loc, qkv, gate, beta, alpha, pack, total)
        else:  # an empty pack: an empty output, and zero (not missing) grads for every parameter
            unused = loc.conv_w.sum() + loc.A_log.sum() + loc.dt_bias.sum()
            out = gate + 0 * (unused if loc.conv_b is None else unused + loc.conv_b.sum())
        if getattr(layer, "recompute_norm_out", False):
            # 0.19's selective recompute of "gdn_norm_out", as the release runs it: the gated norm (and the exchange
            # back to context parallel) through megatron's output-discarding checkpoint, recomputed in backward
            from megatron.core import tensor_parallel

            # fp8=None: 0.19.2 sets ``self.fp8 = fp8 is not None``, so its default (False) reads as fp8 and needs
            # Transformer Engine; the gated norm has no fp8 layer, so no fp8 recompute context is needed
            checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=None)
            norm_out = checkpoint.checkpoint(lambda o, z: finish(layer._apply_gated_norm(o, z)), out, gate)
        else:
            norm_out = finish(layer._apply_gated_norm(out, gate))
    result = layer.out_proj(norm_out)
    if checkpoint is not None:
        checkpoint.discard_output_and_register_recompute(result[0])
    return result


def pack_of(layer: Any, hidden_states: torch.Tensor, psp: Any, cp: int) -> Pack:
    local, batch, _ = hidden_states.shape
    total = local * layer.sp_size * cp
    if psp is not None:
        if batch != 1:
            raise ValueError(f"gdn_compat THD: packed input must be [tokens, 1, hidden], got batch {batch} "
                             f"(hidden_states shape {tuple(hidden_states.shape)})")
        return pack_for(psp, total, hidden_states.device, cp)
    if cp > 1 and total % (2 * cp):
        raise ValueError(f"gdn_compat: with context parallel size {cp} the sequence length must be divisible "
                         f"by 2 x cp = {2 * cp}; got {total} ({local} local tokens)")
    return rows_pack(total, batch, cp, hidden_states.device)


def route_skip(facts: Facts, legacy: str) -> str | None:
    """Why a route of the 0.18/0.19 native forward through this packed path does not apply here (None: it
    may); ``legacy`` says what gdn_thd itself covers on a release without native THD."""
    mc = facts.release
    if facts.gdn in (Layout.ABSENT, Layout.UNKNOWN):
        return f"{mc} has no GatedDeltaNet" if facts.gdn is Layout.ABSENT else "GatedDeltaNet not readable"
    if facts.gdn_thd is Thd.REFUSES:
        return f"{mc} GatedDeltaNet has no native THD; {legacy}"
    if facts.gdn_thd is not Thd.NATIVE or not facts.gdn_native_shape:
        return (f"not patched, unknown GatedDeltaNet shape: {facts.notes.get('gdn_thd', facts.gdn_thd)}; gdn_compat "
                f"routes only the 0.18/0.19 forward signature and helpers")
    return None


FAST = "_gdn_compat_fast"  # the opt-in paths a route's core takes (gdn_flashqla, gdn_fused)


def fast_below(original: Any) -> Fast:
    """The opt-in paths of the gdn_compat routes already installed under ``original`` (they combine)."""
    found, func = Fast(), original
    while getattr(func, MARKER, None):
        below = getattr(func, FAST, None) or Fast()
        found = found | below
        func = getattr(func, "__wrapped__", None)
    return found


def carrier_skip(facts: Facts, legacy: str | None = None) -> str | None:
    """Why gdn_compat's packed path cannot carry a route on this release. On 0.16/0.17: ``legacy`` (what gdn_thd itself
    covers there) for a route of the native forward, else what gdn_thd needs (the opt-in paths, gdn_flashqla and
    gdn_fused, require gdn_thd there). On 0.18/0.19: a missing or unusable fla (with the fix), then the native
    shape."""
    if facts.gdn_thd is Thd.REFUSES:
        return decide(facts) if legacy is None else route_skip(facts, legacy)
    problem = None if facts.gdn is Layout.ABSENT else fla_problem(facts)
    return f"not patched: {problem}" if problem else route_skip(facts, legacy or "")


def needs_gdn_thd(facts: Facts) -> tuple[str, ...]:
    """``requires`` of a route: gdn_thd on a release without native THD (it is the packed path there)."""
    return ("gdn_thd",) if facts.gdn_thd is Thd.REFUSES else ()


def fla_backend(layer: Any) -> bool:
    """The layer runs fla's kernels: upstream main's ``gdn_kernel_backend`` (#6645, a TE/cuDNN core) set to anything
    else keeps the release's own forward, whose kernels gdn_compat's path would replace."""
    backend = getattr(getattr(layer, "config", None), "gdn_kernel_backend", None)
    return backend in (None, "fla")


def route(facts: Facts, original: Any, takes: Callable[[Any], bool], paths: Fast = fast.NONE,
          wants: Callable[[Any, Pack], bool] | None = None, must: str | None = None) -> Any:
    """A replacement for ``GatedDeltaNet.forward`` that runs this packed path for the packed calls
    (``qkv_format='thd'``, no inference context) of layers ``takes(layer)`` selects (and, given ``wants``, whose
    pack ``wants(layer, pack)`` selects), and ``original`` for every other call: the one wrapper behind gdn_compat's
    routes. ``original`` is the 0.18/0.19 native-THD forward (or a route over it), or on 0.16/0.17 gdn_thd's
    replacement (or a route over it); the wrapper has that release's signature. ``paths`` (and those of routes
    underneath) choose the core's opt-in paths. A layer one of whose release methods this path computes itself
    (``UNFUSED_OWN``) is not the release's own at this call (``own.py``: replaced on the release class, a subclass or
    the layer, at any time) keeps ``original``, said once; where ``original`` would be wrong for the call (``must``,
    formatted with ``why``) that is an error instead."""
    below = fast_below(original)
    paths = paths | below
    core = Core(sys.modules[original.__module__], facts.fla_varlen, facts.fla_atomic_free, paths)

    def packed(self, hidden_states, packed_seq_params, inference_context, inference_params) -> bool:
        return (packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
                and inference_context is None and inference_params is None and fla_backend(self) and takes(self))

    def run(self, hidden_states, packed_seq_params, release: Callable[[], Any]):
        cp = cpx.size_of(self)
        pack = pack_of(self, hidden_states, packed_seq_params, cp)
        if wants is not None and not wants(self, pack):
            return release()
        why = core.replaced(self, UNFUSED_OWN, "gdn_compat's packed path")
        if why is not None:
            if must:
                raise ValueError(must.format(why=why))
            fast.note("gdn_compat's packed path", why, instead="the release's own forward runs that layer")
            return release()
        return packed_forward(self, core, hidden_states, pack, cp)

    if facts.gdn_thd is Thd.REFUSES:  # 0.16/0.17: the legacy signature, gdn_thd underneath
        @functools.wraps(original)
        def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                    attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                    inference_params=None, **kwargs):
            def release():
                return original(self, hidden_states, attention_mask, key_value_states, inference_context,
                                attention_bias, packed_seq_params, sequence_len_offset,
                                inference_params=inference_params, **kwargs)

            if packed(self, hidden_states, packed_seq_params, inference_context, inference_params):
                return run(self, hidden_states, packed_seq_params, release)
            return release()
    else:
        @functools.wraps(original)
        def forward(self, hidden_states, attention_mask, inference_context=None, packed_seq_params=None,
                    sequence_len_offset=None, *, inference_params=None, **kwargs):
            def release():
                return original(self, hidden_states, attention_mask, inference_context, packed_seq_params,
                                sequence_len_offset, inference_params=inference_params, **kwargs)

            if packed(self, hidden_states, packed_seq_params, inference_context, inference_params):
                return run(self, hidden_states, packed_seq_params, release)
            return release()

    setattr(forward, FAST, paths)
    return forward


def build(facts: Facts, original: Any) -> Any:
    """The replacement ``GatedDeltaNet.forward``; ``original`` is the release's."""
    release = sys.modules[original.__module__]  # bound once: its l2norm and torch rule
    core = Core(release, facts.fla_varlen, facts.fla_atomic_free)
    version = facts.release

    @functools.wraps(original)
    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                inference_params=None, **kwargs):
        packed = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
        cp = cpx.size_of(self)
        if not packed and cp == 1:
            return original(self, hidden_states, attention_mask, key_value_states, inference_context,
                            attention_bias, None, sequence_len_offset,
                            inference_params=inference_params, **kwargs)
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(f"gdn_compat: GatedDeltaNet on {version} with "
                                      f"{'packed sequences' if packed else f'context parallel size {cp}'} and an "
                                      f"inference context is not supported (neither upstream)")
        pack = pack_of(self, hidden_states, packed_seq_params if packed else None, cp)
        return packed_forward(self, core, hidden_states, pack, cp)

    return forward


PATCH = Patch(
    name="gdn_thd",
    target=Target(GDN_MODULE, "GatedDeltaNet", "forward"),
    decide=decide,
    build=build,
    summary="GatedDeltaNet.forward accepts packed sequences (qkv_format='thd') and context parallelism; "
            "unpacked input at cp=1 runs the release's own code (upstream PR #2645)",
)
