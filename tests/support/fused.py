"""Inputs and helpers for the fused-kernel tests (tests/test_fused_kernels.py, tests/test_gdn_fused.py)."""

from __future__ import annotations

import os

import torch

# empty entries at the start, middle and end; a length-1 sequence; lengths across 16/32-token blocks and
# 64-token chunks
LENGTHS = [0, 1, 33, 0, 64, 65, 17, 2, 0]
CU = [0]
for _n in LENGTHS:
    CU.append(CU[-1] + _n)
DIMS = dict(hk=2, hv=4, dk=16, dv=16)


def interpreted_or_cuda() -> str | None:
    """Why the Triton kernels cannot run here (None: on CUDA, or in Triton's interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "no CUDA and TRITON_INTERPRET is not 1"


def token_bounds(cu: list[int], tokens: int):
    from gdn_compat.fused.region import token_bounds as bounds

    return bounds(torch.tensor(cu, dtype=torch.int32), tokens)


def inputs(channels: int, width: int, bias: bool, extra: int = 0, seed: int = 1):
    torch.manual_seed(seed)
    x = torch.randn(CU[-1], channels + extra)
    w = torch.randn(channels, width) * 0.5
    return x, w, (torch.randn(channels) * 0.1 if bias else None)


def region_inputs(seed: int = 2, conv_bias: bool = True):
    hk, hv, dk, dv = DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"]
    torch.manual_seed(seed)
    channels = 2 * hk * dk + hv * dv
    x = torch.randn(CU[-1], channels + hv * dv + 2 * hv)
    params = {
        "conv_w": torch.randn(channels, 1, 4) * 0.4,
        "conv_b": torch.randn(channels) * 0.1 if conv_bias else None,
        "A_log": torch.randn(hv) * 0.5,
        "dt_bias": torch.randn(hv) * 0.5,
        "norm_w": 1 + 0.1 * torch.randn(dv),
    }
    return x, params


def gradients(fn, x, params: dict):
    """(output, {name: grad}) of ``fn(x, *params)`` for a fixed output gradient; None params stay None."""
    leaves = {k: (None if v is None else v.detach().clone().requires_grad_(True)) for k, v in params.items()}
    xx = x.detach().clone().requires_grad_(True)
    y = fn(xx, *leaves.values())
    dy = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    y.backward(dy)
    grads = {"x": xx.grad, **{k: v.grad for k, v in leaves.items() if v is not None}}
    return y.detach(), grads


def ref_core(cu: list[int]):
    """A TorchCore over the reference's token-by-token recurrence (no megatron needed)."""
    from gdn_compat.fused import reference
    from gdn_compat.fused.cores import TorchCore

    def rule(q, k, v, g, beta, **_):
        bounds = [0, q.shape[1]]
        return reference.delta_rule(q[0], k[0], v[0], g[0].to(q.dtype), beta[0].to(q.dtype), bounds)[None], None

    return TorchCore(rule, tuple(reference.spans(cu)))


class FakeFlashQla:
    """A stand-in for the ``flash_qla`` module's fwd/bwd with FlashQLA's contract (q/k with fewer heads than v,
    dq/dk returned per key head, g in log space, offsets as given), computed by the reference recurrence with
    autograd: it checks what gdn_compat hands FlashQLA, not FlashQLA itself."""

    def __init__(self):
        self.calls: list[dict] = []

    def _run(self, q, k, v, g, beta, cu):
        from gdn_compat.fused import reference

        rep = v.shape[2] // k.shape[2]
        return reference.delta_rule(q[0].repeat_interleave(rep, 1), k[0].repeat_interleave(rep, 1), v[0],
                                    g[0].to(q.dtype), beta[0].to(q.dtype), cu.tolist())[None]

    def _record(self, what, q, v, cu, auto_cp, kw):
        self.calls.append({"q_heads": q.shape[2], "v_heads": v.shape[2], "cu_dtype": cu.dtype, "auto_cp": auto_cp,
                           "pass": what, "cp_context": kw.get("cp_context")})

    def chunk_gated_delta_rule_fwd(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state,
                                   output_h, auto_cp, **kw):
        self._record("fwd", q, v, cu_seqlens, auto_cp, kw)
        with torch.no_grad():
            o = self._run(q, k, v, g, beta, cu_seqlens)
        return g.clone(), torch.zeros(1), o, None, None, None  # (g_cum, A, o, h, final_state, cp_cache)

    def chunk_gated_delta_rule_bwd(self, q, k, v, g, beta, A, do, dht, scale, initial_state, cu_seqlens, auto_cp,
                                   **kw):
        self._record("bwd", q, v, cu_seqlens, auto_cp, kw)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
            o = self._run(*leaves, cu_seqlens)
            dq, dk, dv, dg, db = torch.autograd.grad(o, leaves, do)
        return dq, dk, dv, db, dg, None
