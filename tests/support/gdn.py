"""Build a real megatron-core GatedDeltaNet and an independent pure-torch reference of its math."""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

QWEN3_NEXT = dict(hidden=2048, dk=128, dv=128, hk=16, hv=32)  # GDN layer shape of the GPU tests and benchmarks
# Every layer shape users train, as one rank's kernels see it (#37): name -> (dims, key heads, value heads). A tp
# shard keeps the model's hidden size and gets 1/tp of the heads (tp 2: 8 / 16 of Qwen3-Next's 16 / 32; tp 8: 2 / 4).
_NEXT, _QWEN35 = dict(hidden=2048, dk=128, dv=128), dict(hidden=4096, dk=128, dv=128)
LAYER_SHAPES = {
    "qwen3-next": (_NEXT, 16, 32), "qwen3-next-tp2": (_NEXT, 8, 16), "qwen3-next-tp4": (_NEXT, 4, 8),
    "qwen3-next-tp8": (_NEXT, 2, 4),
    "qwen3.5": (_QWEN35, 16, 64), "qwen3.5-tp2": (_QWEN35, 8, 32), "qwen3.5-tp4": (_QWEN35, 4, 16),
    "qwen3.5-tp8": (_QWEN35, 2, 8),
    "ratio-3": (_NEXT, 16, 48),  # a 3:1 value / key head ratio, as in upstream's newer hybrids
}
DESIGN_LENGTHS = [4093, 2050, 1531, 1029, 3070, 509, 771, 1283, 2048]  # design.md section 5: 16,384 tokens
# an RL rollout pack: 16 sequences of 256-1,000 tokens, 8,393 tokens
RL_LENGTHS = [256, 1000, 512, 768, 300, 900, 640, 700, 280, 460, 520, 384, 610, 333, 420, 310]


def offsets(lengths: list[int]) -> list[int]:
    """cu_seqlens of a pack: [0, l0, l0 + l1, ...]."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def shard(x: torch.Tensor, lengths: list[int], cp: int, rank: int) -> torch.Tensor:
    """Megatron's load-balanced layout: rank r keeps chunks r and 2cp-1-r of every sequence."""
    out, start = [], 0
    for n in lengths:
        chunks = x[start:start + n].chunk(2 * cp)
        out += [chunks[rank], chunks[2 * cp - 1 - rank]]
        start += n
    return torch.cat(out)


def unshard(parts: list[torch.Tensor], lengths: list[int], cp: int) -> torch.Tensor:
    """The whole pack from every rank's shard (the inverse of ``shard``)."""
    out, starts = [], [0] * cp
    for n in lengths:
        h, slots = n // (2 * cp), [None] * (2 * cp)
        for r in range(cp):
            slots[r] = parts[r][starts[r]:starts[r] + h]
            slots[2 * cp - 1 - r] = parts[r][starts[r] + h:starts[r] + 2 * h]
            starts[r] += 2 * h
        out += slots
    return torch.cat(out)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in the 2-norm, in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def err_of(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative distance in the 2-norm, in float64 (for distances from a float64 truth)."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def host_syncs(step) -> list[str]:
    """Run ``step`` under torch's sync debug mode; the device-to-host syncs it reported."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # torch announces the debug mode itself once ("... is a prototype feature ..."): not a sync
    return [str(w.message) for w in caught
            if "synchroniz" in str(w.message) and "prototype feature" not in str(w.message)]


def build_gdn(device="cpu", dtype=torch.float32, hidden=64, dk=16, dv=16, hk=2, hv=4, deterministic=False, seed=0,
              cp_group=None):
    """A release GatedDeltaNet; `cp_group` replaces the context-parallel group (default: megatron's)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, use_cpu_initialization=(device == "cpu"),
        linear_conv_kernel_dim=4, linear_key_head_dim=dk, linear_value_head_dim=dv,
        linear_num_key_heads=hk, linear_num_value_heads=hv, normalization="RMSNorm",
        activation_func=F.silu, params_dtype=dtype, bf16=(dtype == torch.bfloat16),
        deterministic_mode=deterministic,
    )
    sub = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    if cp_group is not None:
        pg.cp = cp_group
    m = GatedDeltaNet(cfg, sub, layer_number=1, pg_collection=pg)
    m = m.to(device=device, dtype=dtype)
    with torch.no_grad():  # give every parameter a non-trivial value (norm weights start at 1)
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def packed(cu, padded=None, fmt="thd", kv=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.as_tensor(cu, dtype=torch.int32)
    pad = None if padded is None else torch.as_tensor(padded, dtype=torch.int32)
    return PackedSeqParams(qkv_format=fmt, cu_seqlens_q=cu, cu_seqlens_kv=cu if kv is None else kv,
                           cu_seqlens_q_padded=pad, cu_seqlens_kv_padded=pad)


def l2norm_ref(x, eps=1e-6):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def reference_gdn(params: dict, cfg: dict, x: torch.Tensor, spans) -> torch.Tensor:
    """Independent GDN math: token-by-token gated delta rule, state zeroed at each span start.

    params: the module's named parameters (any dtype; computed in float64). x: [T, H]."""
    p = {k: v.double() for k, v in params.items()}
    dk, dv, hk, hv, K = cfg["dk"], cfg["dv"], cfg["hk"], cfg["hv"], cfg["kernel"]
    qk_dim, v_dim = dk * hk, dv * hv
    proj = x.double() @ p["in_proj.weight"].t()
    qkv, z, b, a = torch.split(proj, [2 * qk_dim + v_dim, v_dim, hv, hv], dim=-1)
    w = p["conv1d.weight"][:, 0, :]  # [D, K]
    out = torch.zeros(x.shape[0], v_dim, dtype=torch.float64)
    for start, end in spans:
        L = end - start
        seg = qkv[start:end]
        conv = torch.zeros_like(seg)
        for t in range(L):
            for j in range(K):  # w[:, K-1-j] multiplies x[t-j]
                if t - j >= 0:
                    conv[t] += w[:, K - 1 - j] * seg[t - j]
        conv = F.silu(conv)
        q, k, v = torch.split(conv, [qk_dim, qk_dim, v_dim], dim=-1)
        q = l2norm_ref(q.reshape(L, hk, dk)).repeat_interleave(hv // hk, dim=1)
        k = l2norm_ref(k.reshape(L, hk, dk)).repeat_interleave(hv // hk, dim=1)
        v = v.reshape(L, hv, dv)
        g = -p["A_log"].exp() * F.softplus(a[start:end] + p["dt_bias"])
        beta = torch.sigmoid(b[start:end])
        S = torch.zeros(hv, dk, dv, dtype=torch.float64)
        o = torch.zeros(L, hv, dv, dtype=torch.float64)
        for t in range(L):
            S = S * g[t].exp()[:, None, None]
            u = (v[t] - torch.einsum("hk,hkv->hv", k[t], S)) * beta[t][:, None]
            S = S + torch.einsum("hk,hv->hkv", k[t], u)
            o[t] = torch.einsum("hk,hkv->hv", q[t] / math.sqrt(dk), S)
        rms = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg["eps"]) * p["out_norm.weight"]
        y = rms * F.silu(z[start:end].reshape(L, hv, dv))
        out[start:end] = y.reshape(L, v_dim)
    return out @ p["out_proj.weight"].t()


def packed_run(m, x: torch.Tensor, psp, dy: torch.Tensor | None = None):
    """One forward + backward of a GDN layer on a fresh leaf copy of ``x``: (output, input grad,
    {parameter: grad}), all detached. ``dy`` is the output gradient (default: a fixed ramp)."""
    x = x.detach().clone().requires_grad_(True)
    m.zero_grad(set_to_none=True)
    out, bias = m(x, None, packed_seq_params=psp)
    assert bias is None
    if dy is None:
        dy = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape).to(out.dtype)
    out.backward(dy)
    return out.detach(), x.grad.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def fp32_truth(ref, x: torch.Tensor, dys: list[torch.Tensor], lengths: list[int]) -> list[dict]:
    """Per draw: ``ref`` (the fp32 deterministic_mode copy) run on every sequence alone, its output, input grad and
    every parameter grad."""
    cu, wants = offsets(lengths), []
    for dy in dys:
        ref.zero_grad(set_to_none=True)
        outs, dxs = [], []
        for a, b in zip(cu, cu[1:]):
            if b == a:
                continue
            xi = x[a:b].float().detach().requires_grad_(True)
            oi = ref(xi, None)[0]
            oi.backward(dy[a:b].float())
            outs.append(oi.detach())
            dxs.append(xi.grad)
        wants.append({"out": torch.cat(outs), "dx": torch.cat(dxs),
                      **{n: p.grad.detach().clone() for n, p in ref.named_parameters()}})
    return wants


def use_torch_l2norm(monkeypatch) -> None:
    """The release's unpacked GDN calls fla's Triton l2norm; on the CPU give it a torch one, in
    every module of this release's GDN that looks it up (0.19 splits GDN into a package)."""
    import sys

    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron.core.ssm.gated_delta_net") and hasattr(mod, "l2norm"):
            monkeypatch.setattr(mod, "l2norm", l2norm_ref)


CHUNK = 16


def use_short_chunks(monkeypatch) -> None:
    """The release's ``torch_chunk_gated_delta_rule`` with 16-token chunks instead of 64, for the CPU matrices whose
    packs hold sequences of at most 16 tokens: each sequence is still one chunk, and the rule's loop over a chunk's
    rows (forward and its autograd graph) runs 15 steps instead of 63 over padding (a call of 9 or 16 tokens, 8 heads:
    ~15 ms -> ~3.5 ms forward + backward). The function object stays the release's (its default changed in place), so
    gdn_compat still sees the release's rule and not a replaced one."""
    import inspect
    import sys

    rules = {m.torch_chunk_gated_delta_rule for n, m in list(sys.modules.items())  # one function, several modules
             if n.startswith("megatron.core.ssm.gated_delta_net") and hasattr(m, "torch_chunk_gated_delta_rule")}
    for rule in rules:
        defaults = [p for p in inspect.signature(rule).parameters.values()
                    if p.default is not inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
        names = [p.name for p in defaults]
        if "chunk_size" not in names or len(defaults) != len(rule.__defaults__):
            raise RuntimeError(f"{rule.__module__}.torch_chunk_gated_delta_rule{inspect.signature(rule)}: no "
                               f"chunk_size default where expected")
        values = list(rule.__defaults__)
        values[names.index("chunk_size")] = CHUNK
        monkeypatch.setattr(rule, "__defaults__", tuple(values))


def fla_on_cpu(setattr_=setattr) -> None:
    """fla's varlen ``causal_conv1d`` and ``chunk_gated_delta_rule`` (and its ``l2norm``) in plain torch,
    one sequence at a time, put into this release's GDN modules: the release's own native THD path (and
    its context parallelism) then runs on the CPU. ``setattr_`` is ``monkeypatch.setattr`` in a test
    process, the builtin in a throwaway rank process."""
    import sys

    import torch.nn.functional as F

    from gdn_compat.patches.gdn_thd.own import STANDS_FOR_FLA

    modules = [m for n, m in list(sys.modules.items())
               if n.startswith("megatron.core.ssm.gated_delta_net") and hasattr(m, "chunk_gated_delta_rule")]
    rule = next(m.torch_chunk_gated_delta_rule for n, m in sys.modules.items()
                if n.startswith("megatron.core.ssm.gated_delta_net") and hasattr(m, "torch_chunk_gated_delta_rule"))

    def bounds(cu, total):
        cu = [0, total] if cu is None else cu.tolist()
        return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]

    def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, **_):
        width, outs = weight.shape[-1], []
        for a, b in bounds(cu_seqlens, x.shape[1]):
            seg = F.conv1d(x[:, a:b].transpose(1, 2), weight[:, None], bias, padding=width - 1,
                           groups=weight.shape[0])[..., :b - a]
            outs.append((F.silu(seg) if activation in ("silu", "swish") else seg).transpose(1, 2))
        return torch.cat(outs, 1), None

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
        outs = [rule(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], initial_state=None,
                     output_final_state=False, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
                for a, b in bounds(cu_seqlens, q.shape[1])]
        return torch.cat(outs, 1), None

    # it computes fla's rule: gdn_compat's packed paths take a layer only while its rule is fla's (or the release's
    # torch rule), and leave any other rule to the release (gdn_compat/patches/gdn_thd/own.py)
    setattr(chunk_gated_delta_rule, STANDS_FOR_FLA, True)
    for m in modules:
        setattr_(m, "causal_conv1d", causal_conv1d)
        setattr_(m, "chunk_gated_delta_rule", chunk_gated_delta_rule)
    for name, m in list(sys.modules.items()):  # 0.19 imports l2norm into the package's common.py
        if name.startswith("megatron.core.ssm.gated_delta_net") and hasattr(m, "l2norm"):
            setattr_(m, "l2norm", l2norm_ref)


def captured_layer_step(layer, x0: torch.Tensor, dy: torch.Tensor, psp):
    """One CUDA-graph capture of a packed GDN layer's forward + backward on a static input (a leaf copy of ``x0``)
    and ``psp`` (a PackBuffer's params): (graph, static input, {"out", "dx", parameter: grad} of the graph's own
    tensors). Eager reference runs give ``.grad`` fresh tensors, so the graph's stay intact."""
    import gdn_compat

    sx = x0.clone().requires_grad_(True)

    def step():
        layer.zero_grad(set_to_none=True)
        sx.grad = None
        out = layer(sx, None, packed_seq_params=psp)[0]
        out.backward(dy)
        return out

    graph, out = gdn_compat.graphs.capture(step)
    return graph, sx, {"out": out, "dx": sx.grad, **{n: p.grad for n, p in layer.named_parameters()}}


# What frameworks put in place of a GatedDeltaNet method (tests of replaced methods, #41 / #53):
def sigmoid_gate(self, x, gate):  # another output-gate activation (upstream main's --gdn-output-gate-activation)
    y = self.out_norm(x.reshape(-1, x.shape[-1]))
    return (y * torch.sigmoid(gate.reshape(-1, gate.shape[-1]).float())).to(x.dtype)


def clamped_decay(self, A_log_local_cp, dt_bias_local_cp, alpha, beta):  # a clamped decay in place of the gate
    g = -A_log_local_cp.float().exp() * F.softplus(alpha.float() + dt_bias_local_cp)
    return g.clamp(min=-0.5), beta.sigmoid()
