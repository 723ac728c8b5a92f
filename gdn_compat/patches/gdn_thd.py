"""gdn_thd: packed sequences (``qkv_format='thd'``) for GatedDeltaNet on megatron-core 0.16.x/0.17.x.

Those releases raise ``NotImplementedError`` for any ``packed_seq_params``. Upstream added THD in
NVIDIA/Megatron-LM PR #2645 (released in 0.18.0); this replacement gives 0.16/0.17 the same
contract and, on CUDA, runs the same fla kernels in the same order as 0.18/0.19's native path:

* not packed (``None``, ``'bshd'``, ``'sbhd'``, ...): the release's own forward, with
  ``packed_seq_params=None``;
* packed on CUDA: fla's varlen ``causal_conv1d`` and ``chunk_gated_delta_rule`` over the whole pack,
  no Python loop over sequences, host lengths from a per-pack cache (one device-to-host copy per
  pack, shared by every GDN layer), so a layer call itself never syncs;
* packed on CPU tensors or in ``deterministic_mode``: pure torch (no Triton), one sequence at a
  time with the release's conv weights through ``F.conv1d`` (what its ``nn.Conv1d`` computes) and
  its ``torch_chunk_gated_delta_rule``. Upstream refuses
  THD in deterministic mode; we do not.

Zero-length sequences (repeated ``cu_seqlens`` offsets, e.g. from pack alignment) hold no tokens and
are dropped before the kernels run, which is exactly equivalent.
Context parallelism: these releases' GDN has none and with cp > 1 silently treats each rank's shard
as a whole sequence. The replacement implements it for packed and unpacked input (see
``_context_parallel``); with cp = 1 unpacked input still runs the release's own code.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from gdn_compat._probe import GDN_MODULE, Facts, _accepts, _dist_version
from gdn_compat._registry import Patch
from gdn_compat.patches import _context_parallel as cpx

NAME = "gdn_thd"
TARGET = f"{GDN_MODULE}.GatedDeltaNet.forward"


def decide(facts: Facts) -> str | None:
    mc = f"megatron-core {facts.megatron}"
    if facts.gdn == "absent":
        return f"{mc} has no GatedDeltaNet"
    if facts.gdn.startswith("unknown"):
        return f"not patched: {facts.gdn}"
    if facts.gdn_thd == "native":
        return f"{mc} GatedDeltaNet.forward already handles qkv_format='thd' (upstream PR #2645)"
    if facts.gdn_thd != "refuses":
        return f"not patched, unknown GatedDeltaNet shape: {facts.gdn_thd}"
    if not facts.gdn_legacy_shape:
        return ("not patched, unknown GatedDeltaNet shape: forward refuses THD but its signature or "
                "helpers (_apply_gated_norm, l2norm, torch_chunk_gated_delta_rule) differ from 0.16/0.17")
    if facts.gdn_cp == "native":
        return "not patched, unknown GatedDeltaNet shape: refuses THD yet has context parallelism"
    return None


# ---------------------------------------------------------------------------------------------
# The pack: validated cu_seqlens, on host and device, cached per pack.


@dataclasses.dataclass(frozen=True)
class Pack:
    cu: torch.Tensor  # device cu_seqlens handed to fla (zero-length sequences removed)
    cu_cpu: torch.Tensor  # the same offsets on the host
    spans: tuple[tuple[int, int], ...]  # (start, end) of every non-empty sequence
    perm: torch.Tensor | None = None  # context parallel: received rows -> global token order
    inverse: torch.Tensor | None = None  # and back


def _resolve(psp: Any, side: str) -> tuple[str, torch.Tensor | None]:
    padded = getattr(psp, f"cu_seqlens_{side}_padded", None)
    if padded is not None:
        return f"cu_seqlens_{side}_padded", padded
    return f"cu_seqlens_{side}", getattr(psp, f"cu_seqlens_{side}", None)


def _check_tensor(name: str, t: Any, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gdn_compat THD: {name} must be a torch.Tensor of int32/int64 offsets, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"gdn_compat THD: {name} has dtype {t.dtype}; expected torch.int32 or torch.int64")
    if t.dim() != 1 or t.numel() < 2:
        raise ValueError(f"gdn_compat THD: {name} must be 1-D with at least 2 offsets, got shape {tuple(t.shape)}")
    if t.device.type != "cpu" and t.device != device:
        raise ValueError(f"gdn_compat THD: {name} is on {t.device} but hidden_states are on {device}; "
                         f"expected a host tensor or one on {device}")


class _PackCache:
    """Last few packs, keyed by the identity *and* in-place version of their cu_seqlens tensors,
    so every GDN layer of a micro-batch shares one validation and one host copy, while a tensor
    modified in place is never served stale."""

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: list[tuple[Any, ...]] = []

    @staticmethod
    def _key(tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        return tuple((weakref.ref(t), t._version) for t in tensors)

    def get(self, tensors: tuple[torch.Tensor, ...], total: int, scope: Any) -> Pack | None:
        for key, k_total, k_scope, pack in self.entries:
            if (k_total == total and k_scope == scope and len(key) == len(tensors)
                    and all(r() is t and v == t._version for (r, v), t in zip(key, tensors))):
                return pack
        return None

    def put(self, tensors: tuple[torch.Tensor, ...], total: int, scope: Any, pack: Pack) -> None:
        self.entries = [e for e in self.entries if all(r() is not None for r, _ in e[0])]
        self.entries.insert(0, (self._key(tensors), total, scope, pack))  # scope: (device, cp)
        del self.entries[self.size:]

    def clear(self) -> None:
        self.entries.clear()


PACKS = _PackCache()


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _cp_perm(lengths: list[int], cp: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if cp == 1:
        return None, None
    perm = cpx.load_balance_perm(lengths, cp)
    return _to_device(perm, device), _to_device(torch.argsort(perm), device)


def pack_for(psp: Any, total: int, device: torch.device, cp: int = 1) -> Pack:
    """Validate ``packed_seq_params`` for a pack of ``total`` tokens; cached per pack."""
    q_name, q = _resolve(psp, "q")
    kv_name, kv = _resolve(psp, "kv")
    if q is None:
        raise ValueError("gdn_compat THD: packed_seq_params has neither cu_seqlens_q_padded nor cu_seqlens_q")
    _check_tensor(q_name, q, device)
    tensors: tuple[torch.Tensor, ...] = (q,)
    if kv is not None and kv is not q:
        _check_tensor(kv_name, kv, device)
        tensors = (q, kv)
    hit = PACKS.get(tensors, total, (device, cp))
    if hit is not None:
        return hit
    # The single device-to-host copy of this pack (none when the offsets already live on the host).
    host = torch.cat([t.detach().to("cpu", torch.int64) for t in tensors]).tolist()
    q_host, kv_host = host[: q.numel()], host[q.numel():]
    if kv_host and kv_host != q_host:
        raise ValueError(f"gdn_compat THD: {q_name}={q_host} and {kv_name}={kv_host} differ; "
                         f"GatedDeltaNet needs one set of sequence boundaries")
    if q_host[0] != 0:
        raise ValueError(f"gdn_compat THD: {q_name} must start at 0, got {q_host}")
    if any(b < a for a, b in zip(q_host, q_host[1:])):
        raise ValueError(f"gdn_compat THD: {q_name} must be non-decreasing, got {q_host}")
    if q_host[-1] != total:
        raise ValueError(f"gdn_compat THD: {q_name}[-1]={q_host[-1]} does not match the pack's token count "
                         f"{total} (local tokens x sequence-parallel size x context-parallel size); {q_name}={q_host}")
    lengths = [b - a for a, b in zip(q_host, q_host[1:])]
    if cp > 1 and any(n % (2 * cp) for n in lengths):
        raise ValueError(f"gdn_compat THD with context parallel size {cp}: every sequence length must be "
                         f"divisible by 2 x cp = {2 * cp} (Megatron's load balancing); offending lengths "
                         f"{[n for n in lengths if n % (2 * cp)]} in {q_name}={q_host}")
    spans = tuple((a, b) for a, b in zip(q_host, q_host[1:]) if b > a)
    offsets = [0] + [b for _, b in spans]
    cu_cpu = torch.tensor(offsets, dtype=q.dtype)
    if len(offsets) == q.numel() and q.device == device:
        cu = q  # nothing dropped: hand the caller's own tensor to fla, as upstream does
    else:
        cu = _to_device(cu_cpu, device)
    perm, inverse = _cp_perm(lengths, cp, device)
    pack = Pack(cu=cu, cu_cpu=cu_cpu, spans=spans, perm=perm, inverse=inverse)
    PACKS.put(tensors, total, (device, cp), pack)
    return pack


@functools.lru_cache(maxsize=16)
def _rows_pack(length: int, rows: int, cp: int, device: torch.device) -> Pack:
    """Unpacked [s, b] input under context parallelism: b sequences of ``length`` tokens."""
    offsets = [i * length for i in range(rows + 1)]
    cu_cpu = torch.tensor(offsets, dtype=torch.int32)
    perm, inverse = _cp_perm([length], cp, device)
    spans = tuple(zip(offsets, offsets[1:]))
    return Pack(cu=_to_device(cu_cpu, device), cu_cpu=cu_cpu, spans=spans, perm=perm, inverse=inverse)


# ---------------------------------------------------------------------------------------------
# Kernels.


def l2norm_torch(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm in plain torch: x / sqrt(sum(x^2) + eps), computed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _g_and_beta(A_log: torch.Tensor, dt_bias: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor):
    # Same expression as 0.18's GatedDeltaNet._compute_g_and_beta (PR #2645).
    g = -A_log.exp() * F.softplus(alpha.float() + dt_bias)  # in fp32
    return g, beta.sigmoid()


def _prepare_qkv(qkv, gate, beta, alpha, seq_len: int, qk_local: int, v_local: int, dk: int, dv: int,
                 repeat: int, use_l2norm: bool, l2norm: Any):
    # The steps of 0.18's GatedDeltaNet._prepare_qkv_for_gated_delta_rule (PR #2645): split,
    # reshape, one l2norm over q and k together, split, expand grouped heads, make contiguous.
    query_key, value = torch.split(qkv, [2 * qk_local, v_local], dim=-1)
    query_key = query_key.reshape(1, seq_len, -1, dk)
    value = value.reshape(1, seq_len, -1, dv)
    if use_l2norm:
        query_key = l2norm(query_key.contiguous())
    heads = qk_local // dk
    query, key = torch.split(query_key, [heads, heads], dim=2)
    if repeat > 1:
        query = query.repeat_interleave(repeat, dim=2)
        key = key.repeat_interleave(repeat, dim=2)
    return (query.contiguous(), key.contiguous(), value.contiguous(), gate.contiguous(),
            beta.contiguous(), alpha.contiguous())


@functools.lru_cache(maxsize=1)
def _fused() -> tuple[Any, Any]:
    # 0.18/0.19 run both steps through megatron's jit_fuser (torch.compile), and torch.compile
    # changes how fla's l2norm kernel is launched; so do we, for the same bits as upstream's THD.
    from megatron.core.jit import jit_fuser

    return jit_fuser(_prepare_qkv), jit_fuser(_g_and_beta)


@functools.lru_cache(maxsize=1)
def _fla() -> tuple[Any, Any, dict[str, bool]]:
    from fla.modules.convolution import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    takes = {  # the probe's own signature check (Facts.fla_*), asked of the functions we call
        "conv": _accepts(causal_conv1d, "cu_seqlens") == "yes",
        "conv_cpu": _accepts(causal_conv1d, "cu_seqlens_cpu") == "yes",
        "rule": _accepts(chunk_gated_delta_rule, "cu_seqlens") == "yes",
        "rule_cpu": _accepts(chunk_gated_delta_rule, "cu_seqlens_cpu") == "yes",
    }
    return causal_conv1d, chunk_gated_delta_rule, takes


@dataclasses.dataclass(frozen=True)
class Local:
    """This rank's share of the layer: dims after TP and CP, and its slices of the parameters."""

    qk: int  # q (and k) features
    v: int  # v (and gate) features
    dk: int
    dv: int
    repeat: int  # value heads per key head
    conv_w: torch.Tensor
    conv_b: torch.Tensor | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor


def local_view(self: Any, cp: int, rank: int) -> Local:
    tp, hk, hv = self.tp_size, self.num_key_heads, self.num_value_heads
    if hk % (tp * cp) or hv % (tp * cp):
        raise ValueError(f"gdn_compat: GatedDeltaNet heads must divide by tp x cp = {tp} x {cp}; got "
                         f"{hk} key heads and {hv} value heads")
    qk, v = self.qk_dim // tp, self.v_dim // tp
    conv_w, conv_b, A_log, dt_bias = self.conv1d.weight, self.conv1d.bias, self.A_log, self.dt_bias
    if cp > 1:  # keep q, k and v sections aligned: each is cut into cp head groups
        conv_w = cpx.local_heads(conv_w, [qk, qk, v], cp, rank)
        conv_b = None if conv_b is None else cpx.local_heads(conv_b, [qk, qk, v], cp, rank)
        A_log, dt_bias = A_log.chunk(cp)[rank], dt_bias.chunk(cp)[rank]
    return Local(qk // cp, v // cp, self.key_head_dim, self.value_head_dim, hv // hk, conv_w, conv_b, A_log, dt_bias)


def _core_fla(self: Any, mod: Any, loc: Local, qkv, gate, beta, alpha, pack: Pack, total: int):
    causal_conv1d, chunk_gated_delta_rule, takes = _fla()
    if not (takes["conv"] and takes["rule"]):
        raise RuntimeError("gdn_compat THD on CUDA needs fla's causal_conv1d and chunk_gated_delta_rule "
                           "with cu_seqlens; the installed fla lacks it (install fla-core>=0.4.2)")
    if self.activation not in ("silu", "swish"):
        raise ValueError(f"gdn_compat THD: fla's causal_conv1d supports silu/swish, got activation {self.activation!r}")
    host = {"cu_seqlens_cpu": pack.cu_cpu}
    qkv, _ = causal_conv1d(
        x=qkv, weight=loc.conv_w.squeeze(1), bias=loc.conv_b, activation=self.activation,
        initial_state=None, output_final_state=False, cu_seqlens=pack.cu,
        **(host if takes["conv_cpu"] else {}),
    )
    prepare, g_and_beta = _fused()
    query, key, value, gate, beta, alpha = prepare(
        qkv, gate, beta, alpha, total, loc.qk, loc.v, loc.dk, loc.dv, loc.repeat, bool(self.use_qk_l2norm),
        mod.l2norm,
    )
    g, beta = g_and_beta(loc.A_log, loc.dt_bias, alpha, beta)
    out, _ = chunk_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, cu_seqlens=pack.cu, **(host if takes["rule_cpu"] else {}),
    )
    return out, gate


def _core_torch(self: Any, mod: Any, loc: Local, qkv, gate, beta, alpha, pack: Pack, total: int):
    g, beta = _g_and_beta(loc.A_log, loc.dt_bias, alpha, beta)
    outs = []
    width = loc.conv_w.shape[-1]
    for start, end in pack.spans:  # one sequence at a time: state cannot cross a boundary
        length = end - start
        x = qkv[:, start:end].transpose(1, 2).contiguous()  # b, s, d -> b, d, s
        # what the release's nn.Conv1d computes (padding width-1, one group per channel)
        x = F.conv1d(x, loc.conv_w, loc.conv_b, padding=width - 1, groups=loc.conv_w.shape[0])
        x = self.act_fn(x[..., :length]).transpose(1, 2)
        query, key, value, _, beta_i, g_i = _prepare_qkv(
            x, gate, beta[:, start:end], g[:, start:end], length, loc.qk, loc.v, loc.dk, loc.dv, loc.repeat,
            bool(self.use_qk_l2norm), l2norm_torch,
        )
        out, _ = mod.torch_chunk_gated_delta_rule(
            query, key, value, g=g_i, beta=beta_i, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False,
        )
        outs.append(out)
    if not outs:
        return qkv.new_zeros(1, 0, loc.v // loc.dv, loc.dv), gate
    return torch.cat(outs, dim=1), gate


def cp_group(self: Any) -> Any:
    return getattr(getattr(self, "pg_collection", None), "cp", None)


def cp_size(self: Any) -> int:
    group = cp_group(self)
    return group.size() if group is not None else 1


def _forward(self: Any, mod: Any, hidden_states: torch.Tensor, pack: Pack, cp: int) -> tuple[torch.Tensor, Any]:
    """The GDN over [s_local, b, h] input whose rows are ``pack``'s sequences (b = 1 for THD)."""
    group = cp_group(self)
    loc = local_view(self, cp, group.rank() if cp > 1 else 0)
    qkvzba, _ = self.in_proj(hidden_states)  # gathers the sequence-parallel shards
    if cp > 1:
        assert pack.perm is not None and pack.inverse is not None
        tp_hv = self.num_value_heads // self.tp_size
        sections = [self.qk_dim // self.tp_size] * 2 + [self.v_dim // self.tp_size] * 2 + [tp_hv, tp_hv]
        qkvzba = cpx.cp2hp(qkvzba, sections, pack.perm, group, cp)  # all tokens, this rank's heads
    seq, rows = qkvzba.shape[0], qkvzba.shape[1]
    total = seq * rows
    qkvzba = qkvzba.transpose(0, 1).reshape(1, total, -1)
    hv = loc.v // loc.dv
    qkv, gate, beta, alpha = torch.split(qkvzba, [2 * loc.qk + loc.v, loc.v, hv, hv], dim=-1)
    gate = gate.reshape(1, total, -1, loc.dv)
    beta = beta.reshape(1, total, -1)
    alpha = alpha.reshape(1, total, -1)
    core = _core_fla if hidden_states.is_cuda and not self.config.deterministic_mode else _core_torch
    out, gate = core(self, mod, loc, qkv, gate, beta, alpha, pack, total)
    norm_out = self._apply_gated_norm(out, gate)
    norm_out = norm_out.reshape(rows, seq, -1).transpose(0, 1).contiguous()
    if pack.inverse is not None:
        norm_out = cpx.hp2cp(norm_out, pack.inverse, group, cp)
    return self.out_proj(norm_out)


def thd_forward(self: Any, mod: Any, hidden_states: torch.Tensor, psp: Any) -> tuple[torch.Tensor, Any]:
    local, batch, _ = hidden_states.shape
    if batch != 1:
        raise ValueError(f"gdn_compat THD: packed input must be [tokens, 1, hidden], got batch {batch} "
                         f"(hidden_states shape {tuple(hidden_states.shape)})")
    cp = cp_size(self)
    total = local * self.sp_size * cp
    return _forward(self, mod, hidden_states, pack_for(psp, total, hidden_states.device, cp), cp)


def bshd_cp_forward(self: Any, mod: Any, hidden_states: torch.Tensor, cp: int) -> tuple[torch.Tensor, Any]:
    local, batch, _ = hidden_states.shape
    length = local * self.sp_size * cp
    if length % (2 * cp):
        raise ValueError(f"gdn_compat: with context parallel size {cp} the sequence length must be divisible "
                         f"by 2 x cp = {2 * cp}; got {length} ({local} local tokens)")
    return _forward(self, mod, hidden_states, _rows_pack(length, batch, cp, hidden_states.device), cp)


def build() -> list[tuple[Any, str, Any]]:
    mod = importlib.import_module(GDN_MODULE)
    cls = mod.GatedDeltaNet
    defining = importlib.import_module(cls.__module__)
    original = cls.__dict__["forward"]
    found = _dist_version("megatron-core")
    release = found[1] if found else "(unknown version)"

    @functools.wraps(original)
    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                inference_params=None, **kwargs):
        packed = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
        cp = cp_size(self)
        if not packed and cp == 1:
            return original(self, hidden_states, attention_mask, key_value_states, inference_context,
                            attention_bias, None, sequence_len_offset,
                            inference_params=inference_params, **kwargs)
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(f"gdn_compat: GatedDeltaNet on megatron-core {release} with "
                                      f"{'packed sequences' if packed else f'context parallel size {cp}'} and an "
                                      f"inference context is not supported (neither upstream)")
        if packed:
            return thd_forward(self, defining, hidden_states, packed_seq_params)
        return bshd_cp_forward(self, defining, hidden_states, cp)

    return [(cls, "forward", forward)]


PATCH = Patch(
    name=NAME,
    target=TARGET,
    decide=decide,
    build=build,
    summary="GatedDeltaNet.forward accepts packed sequences (qkv_format='thd') and context parallelism; "
            "unpacked input at cp=1 runs the release's own code (upstream PR #2645)",
)
