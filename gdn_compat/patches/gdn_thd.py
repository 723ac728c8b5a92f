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
  time with the release's own ``nn.Conv1d`` and ``torch_chunk_gated_delta_rule``. Upstream refuses
  THD in deterministic mode; we do not.

Zero-length sequences (repeated ``cu_seqlens`` offsets, e.g. from pack alignment) hold no tokens and
are dropped before the kernels run, which is exactly equivalent.
Context parallelism is not implemented for these releases: cp > 1 raises in both formats, because
the release itself would silently treat each rank's shard as a whole sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from gdn_compat._probe import GDN_MODULE, Facts, _dist_version
from gdn_compat._registry import Patch

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

    def get(self, tensors: tuple[torch.Tensor, ...], total: int, device: torch.device) -> Pack | None:
        for key, k_total, k_device, pack in self.entries:
            if (k_total == total and k_device == device and len(key) == len(tensors)
                    and all(r() is t and v == t._version for (r, v), t in zip(key, tensors))):
                return pack
        return None

    def put(self, tensors: tuple[torch.Tensor, ...], total: int, device: torch.device, pack: Pack) -> None:
        self.entries = [e for e in self.entries if all(r() is not None for r, _ in e[0])]
        self.entries.insert(0, (self._key(tensors), total, device, pack))
        del self.entries[self.size:]

    def clear(self) -> None:
        self.entries.clear()


PACKS = _PackCache()


def pack_for(psp: Any, total: int, device: torch.device) -> Pack:
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
    hit = PACKS.get(tensors, total, device)
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
                         f"{total} (local tokens x sequence-parallel size); {q_name}={q_host}")
    spans = tuple((a, b) for a, b in zip(q_host, q_host[1:]) if b > a)
    offsets = [0] + [b for _, b in spans]
    cu_cpu = torch.tensor(offsets, dtype=q.dtype)
    if len(offsets) == q.numel() and q.device == device:
        cu = q  # nothing dropped: hand the caller's own tensor to fla, as upstream does
    elif device.type == "cuda":
        cu = cu_cpu.pin_memory().to(device, non_blocking=True)
    else:
        cu = cu_cpu.to(device)
    pack = Pack(cu=cu, cu_cpu=cu_cpu, spans=spans)
    PACKS.put(tensors, total, device, pack)
    return pack


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

    takes = {
        "conv": "cu_seqlens" in inspect.signature(causal_conv1d).parameters,
        "conv_cpu": "cu_seqlens_cpu" in inspect.signature(causal_conv1d).parameters,
        "rule": "cu_seqlens" in inspect.signature(chunk_gated_delta_rule).parameters,
        "rule_cpu": "cu_seqlens_cpu" in inspect.signature(chunk_gated_delta_rule).parameters,
    }
    return causal_conv1d, chunk_gated_delta_rule, takes


def _core_fla(self: Any, mod: Any, qkv, gate, beta, alpha, pack: Pack, total: int):
    causal_conv1d, chunk_gated_delta_rule, takes = _fla()
    if not (takes["conv"] and takes["rule"]):
        raise RuntimeError("gdn_compat THD on CUDA needs fla's causal_conv1d and chunk_gated_delta_rule "
                           "with cu_seqlens; the installed fla lacks it (install fla-core>=0.4.2)")
    if self.activation not in ("silu", "swish"):
        raise ValueError(f"gdn_compat THD: fla's causal_conv1d supports silu/swish, got activation {self.activation!r}")
    host = {"cu_seqlens_cpu": pack.cu_cpu}
    qkv, _ = causal_conv1d(
        x=qkv, weight=self.conv1d.weight.squeeze(1), bias=self.conv1d.bias, activation=self.activation,
        initial_state=None, output_final_state=False, cu_seqlens=pack.cu,
        **(host if takes["conv_cpu"] else {}),
    )
    prepare, g_and_beta = _fused()
    query, key, value, gate, beta, alpha = prepare(
        qkv, gate, beta, alpha, total, self.qk_dim // self.tp_size, self.v_dim // self.tp_size,
        self.key_head_dim, self.value_head_dim, self.num_value_heads // self.num_key_heads,
        bool(self.use_qk_l2norm), mod.l2norm,
    )
    g, beta = g_and_beta(self.A_log, self.dt_bias, alpha, beta)
    out, _ = chunk_gated_delta_rule(
        query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
        use_qk_l2norm_in_kernel=False, cu_seqlens=pack.cu, **(host if takes["rule_cpu"] else {}),
    )
    return out, gate


def _core_torch(self: Any, mod: Any, qkv, gate, beta, alpha, pack: Pack, total: int):
    g, beta = _g_and_beta(self.A_log, self.dt_bias, alpha, beta)
    outs = []
    for start, end in pack.spans:  # one sequence at a time: state cannot cross a boundary
        length = end - start
        x = qkv[:, start:end].transpose(1, 2).contiguous()  # b, s, d -> b, d, s
        x = self.act_fn(self.conv1d(x)[..., :length]).transpose(1, 2)
        query, key, value, _, beta_i, g_i = _prepare_qkv(
            x, gate, beta[:, start:end], g[:, start:end], length, self.qk_dim // self.tp_size,
            self.v_dim // self.tp_size, self.key_head_dim, self.value_head_dim,
            self.num_value_heads // self.num_key_heads, bool(self.use_qk_l2norm), l2norm_torch,
        )
        out, _ = mod.torch_chunk_gated_delta_rule(
            query, key, value, g=g_i, beta=beta_i, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False,
        )
        outs.append(out)
    if not outs:
        return qkv.new_zeros(1, 0, self.num_value_heads // self.tp_size, self.value_head_dim), gate
    return torch.cat(outs, dim=1), gate


def cp_size(self: Any) -> int:
    group = getattr(getattr(self, "pg_collection", None), "cp", None)
    return group.size() if group is not None else 1


def thd_forward(self: Any, mod: Any, hidden_states: torch.Tensor, psp: Any) -> tuple[torch.Tensor, Any]:
    local, batch, _ = hidden_states.shape
    if batch != 1:
        raise ValueError(f"gdn_compat THD: packed input must be [tokens, 1, hidden], got batch {batch} "
                         f"(hidden_states shape {tuple(hidden_states.shape)})")
    total = local * self.sp_size
    pack = pack_for(psp, total, hidden_states.device)

    qkvzba, _ = self.in_proj(hidden_states)  # gathers the sequence-parallel shards: [total, 1, d]
    qkvzba = qkvzba.transpose(0, 1)
    tp, hv = self.tp_size, self.num_value_heads // self.tp_size
    qkv, gate, beta, alpha = torch.split(
        qkvzba, [(self.qk_dim * 2 + self.v_dim) // tp, self.v_dim // tp, hv, hv], dim=-1
    )
    gate = gate.reshape(1, total, -1, self.value_head_dim)
    beta = beta.reshape(1, total, -1)
    alpha = alpha.reshape(1, total, -1)
    core = _core_fla if hidden_states.is_cuda and not self.config.deterministic_mode else _core_torch
    out, gate = core(self, mod, qkv, gate, beta, alpha, pack, total)
    norm_out = self._apply_gated_norm(out, gate)
    norm_out = norm_out.reshape(1, total, -1).transpose(0, 1).contiguous()
    return self.out_proj(norm_out)


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
        cp = cp_size(self)
        if cp > 1:
            raise NotImplementedError(
                f"gdn_compat: GatedDeltaNet on megatron-core {release} has no context "
                f"parallelism and would treat each of the {cp} context-parallel shards as a whole "
                f"sequence; use context_parallel_size=1 for GDN models on this release")
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
            return original(self, hidden_states, attention_mask, key_value_states, inference_context,
                            attention_bias, None, sequence_len_offset,
                            inference_params=inference_params, **kwargs)
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("gdn_compat THD: packed sequences with an inference context are not "
                                      "supported (neither upstream); pass inference_context=None")
        return thd_forward(self, defining, hidden_states, packed_seq_params)

    return [(cls, "forward", forward)]


PATCH = Patch(
    name=NAME,
    target=TARGET,
    decide=decide,
    build=build,
    summary="GatedDeltaNet.forward accepts packed sequences (qkv_format='thd'); other formats run the "
            "release's own code (upstream PR #2645)",
)
