"""The fused region's math in plain torch (autograd, any dtype): the reference the kernels are tested against.

Written from the formulas, not from the kernels: per-sequence ``F.conv1d``, SiLU, l2norm, the gate, a
token-by-token delta-rule recurrence, RMSNorm times SiLU(z). Slow; for tests and for reading.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def spans(cu: list[int]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


def conv_act(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cu: list[int]) -> torch.Tensor:
    """silu(causal depthwise conv) of ``x`` ``[T, C]`` restarting at every offset of ``cu``; ``w`` ``[C, W]``."""
    out = torch.zeros_like(x)
    width = w.shape[-1]
    for a, e in spans(cu):
        seg = F.conv1d(x[a:e].t()[None], w[:, None], b, padding=width - 1, groups=w.shape[0])[0, :, : e - a]
        out[a:e] = F.silu(seg.t())
    return out


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gate(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """g in (at least) fp32, the exp of A_log included; beta in b's dtype."""
    wide = torch.promote_types(a.dtype, torch.float32)
    g = -a_log.to(wide).exp() * F.softplus(a.to(wide) + dt_bias.to(wide))
    return g, b.sigmoid()


def delta_rule(q, k, v, g, beta, cu: list[int]) -> torch.Tensor:
    """Token-by-token gated delta rule, state zeroed at every sequence start; q/k ``[T, H, Dk]`` (already
    repeated to v's heads), v ``[T, H, Dv]``, g/beta ``[T, H]``; computed in q's dtype."""
    out = torch.zeros_like(v)
    scale = q.shape[-1] ** -0.5
    for a, e in spans(cu):
        state = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
        rows = []
        for t in range(a, e):
            state = state * g[t].exp()[:, None, None]
            u = (v[t] - torch.einsum("hk,hkv->hv", k[t], state)) * beta[t][:, None]
            state = state + torch.einsum("hk,hv->hkv", k[t], u)
            rows.append(torch.einsum("hk,hkv->hv", q[t] * scale, state))
        out[a:e] = torch.stack(rows)
    return out


def gated_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, zc: float = 0.0) -> torch.Tensor:
    return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * (w + zc) * F.silu(z)


def region(x, conv_w, conv_b, a_log, dt_bias, norm_w, cu: list[int], hk: int, hv: int, dk: int, dv: int,
           l2: bool = True, norm_eps: float = 1e-5, zc: float = 0.0) -> torch.Tensor:
    """y ``[T, hv*dv]`` from the input projection's output ``x`` ``[T, F]`` (q | k | v | z | b | a)."""
    T, qk, vd = x.shape[0], hk * dk, hv * dv
    qkv, z, b, a = torch.split(x, [2 * qk + vd, vd, hv, hv], dim=-1)
    u = conv_act(qkv, conv_w.reshape(conv_w.shape[0], -1), conv_b, cu)
    q, k, v = u[:, :qk].reshape(T, hk, dk), u[:, qk:2 * qk].reshape(T, hk, dk), u[:, 2 * qk:].reshape(T, hv, dv)
    if l2:
        q, k = l2norm(q), l2norm(k)
    q, k = q.repeat_interleave(hv // hk, 1), k.repeat_interleave(hv // hk, 1)
    g, beta = gate(a, b, a_log, dt_bias)
    o = delta_rule(q, k, v, g.to(q.dtype), beta.to(q.dtype), cu)
    return gated_norm(o, z.reshape(T, hv, dv), norm_w, norm_eps, zc).reshape(T, vd)
