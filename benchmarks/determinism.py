"""Which steps of the packed GDN path repeat bit for bit on this GPU stack (#15, item 1).

At the benchmark's shape (Qwen3-Next GDN head shape, bf16, 16,384 tokens in 9 sequences) each step runs
forward + backward --runs times on the same inputs and output-gradient; every output and every input
grad of every run is compared with the first run's bits. Steps: the projections (megatron's parallel
linears), fla's varlen causal_conv1d, the q/k l2norm preparation (megatron's jit_fuser, as upstream),
the gating (g, beta), fla's varlen chunk_gated_delta_rule, the gated RMSNorm, and the whole layer in
deterministic and default mode. A digest per step lets a second process compare (--compare FILE):
fla's autotuner picks launch configurations per process and caches them (FLA_CACHE_RESULTS).

    python -m benchmarks.determinism [--runs 5] [--json FILE] [--compare FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

from tests.support.gdn import DESIGN_LENGTHS, QWEN3_NEXT, build_gdn, offsets, packed


def _run(step, leaves, dys):
    """One forward+backward of ``step`` on fresh leaf copies: [outputs..., input grads...]."""
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in leaves]
    outs = step(*xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward([o for o in outs], [d for d in dys])
    return [o.detach().clone() for o in outs] + [x.grad.clone() for x in xs if x.grad is not None]


def check(name, step, leaves, runs, module=None):
    try:
        return _check(name, step, leaves, runs, module)
    except Exception as exc:  # noqa: BLE001 - one broken step must not hide the others' results
        print(f"[determinism] {name}: {type(exc).__name__}: {exc}")
        return {"step": name, "tensors": 0, "bitwise": False, "differing": -1, "max_abs_diff": float("nan"),
                "digest": "", "error": f"{type(exc).__name__}: {exc}"}


def _check(name, step, leaves, runs, module=None):
    torch.manual_seed(0)
    with torch.no_grad():
        probe = step(*[t.detach().clone() for t in leaves])
    probe = probe if isinstance(probe, tuple) else (probe,)
    dys = [torch.randn_like(o) for o in probe]
    results = []
    for _ in range(runs):
        if module is not None:
            module.zero_grad(set_to_none=True)
        got = _run(step, leaves, dys)
        if module is not None:
            got += [p.grad.clone() for p in module.parameters() if p.grad is not None]
        results.append(got)
    torch.cuda.synchronize()
    differ = [i for i in range(len(results[0])) if any(not torch.equal(r[i], results[0][i]) for r in results[1:])]
    worst = max((float((r[i].float() - results[0][i].float()).abs().max()) for r in results[1:] for i in differ),
                default=0.0)
    digest = hashlib.sha256(b"".join(t.float().cpu().numpy().tobytes() for t in results[0])).hexdigest()[:16]
    return {"step": name, "tensors": len(results[0]), "bitwise": not differ, "differing": len(differ),
            "max_abs_diff": worst, "digest": digest}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--compare", default=None, help="JSON of an earlier process: compare digests")
    args = ap.parse_args()
    from tests.support.megatron import world

    with world(cuda=True):
        rows = measure(args.runs)
    import fla
    import triton

    stack = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
             "fla": getattr(fla, "__version__", "?")}
    print(f"{stack}; {sum(DESIGN_LENGTHS)} tokens in {len(DESIGN_LENGTHS)} sequences, {args.runs} runs per step")
    earlier = {}
    if args.compare:
        with open(args.compare) as fh:
            earlier = {r["step"]: r["digest"] for r in json.load(fh)["rows"]}
    print(f"{'step':<44}{'tensors':>8}  {'run-to-run':<22}{'vs other process' if earlier else ''}")
    for r in rows:
        same = "" if not earlier else ("same bits" if earlier.get(r["step"]) == r["digest"] else "DIFFERENT")
        verdict = "bitwise" if r["bitwise"] else r.get("error") or f"{r['differing']} differ (max {r['max_abs_diff']:.2g})"
        print(f"{r['step']:<44}{r['tensors']:>8}  {verdict:<22}{same}")
        if earlier:
            r["same_as_other_process"] = earlier.get(r["step"]) == r["digest"]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"stack": stack, "lengths": DESIGN_LENGTHS, "runs": args.runs, "rows": rows}, fh, indent=1)
    return 0 if all(r["bitwise"] for r in rows) else 1


def measure(runs):
    from fla.modules.convolution import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    import gdn_compat
    from gdn_compat.patches.gdn_thd import kernels as K
    from gdn_compat.patches.gdn_thd import pack_of

    facts = gdn_compat.apply().facts
    T, H = sum(DESIGN_LENGTHS), QWEN3_NEXT["hidden"]
    layer = build_gdn(device="cuda", dtype=torch.bfloat16, seed=1, **QWEN3_NEXT)
    det = build_gdn(device="cuda", dtype=torch.bfloat16, seed=1, deterministic=True, **QWEN3_NEXT)
    det.load_state_dict(layer.state_dict())
    psp = packed(offsets(DESIGN_LENGTHS))
    psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
    x = torch.randn(T, 1, H, device="cuda", dtype=torch.bfloat16)
    pack = pack_of(layer, x, psp, 1)
    loc = K.local_view(layer, 1, 0)
    with torch.no_grad():
        qkvzba = layer.in_proj(x)[0].transpose(0, 1)
    qkv, gate, beta, alpha = torch.split(qkvzba, [2 * loc.qk + loc.v, loc.v, loc.v // loc.dv, loc.v // loc.dv], -1)
    gate = gate.reshape(1, T, -1, loc.dv)
    prepare, gb = K._fused()
    release_l2norm = K.Core(sys.modules[type(layer).forward.__module__], facts.fla_varlen).l2norm_home.l2norm
    w, b = layer.conv1d.weight.detach().squeeze(1), layer.conv1d.bias
    rows = []

    def conv(q, w_, *b_):
        return causal_conv1d(x=q, weight=w_, bias=b_[0] if b_ else None, activation="silu", initial_state=None,
                             output_final_state=False, cu_seqlens=pack.cu)[0]

    with torch.no_grad():
        conv_out = conv(qkv, w, *([] if b is None else [b.detach()]))
        q, k, v, _, beta_p, alpha_p = prepare(conv_out, gate, beta, alpha, T, loc.qk, loc.v, loc.dk, loc.dv,
                                              loc.repeat, True, release_l2norm)
        g, beta_s = gb(loc.A_log.detach(), loc.dt_bias.detach(), alpha_p, beta_p)
        core = chunk_gated_delta_rule(q, k, v, g=g, beta=beta_s, initial_state=None, output_final_state=False,
                                      use_qk_l2norm_in_kernel=False, cu_seqlens=pack.cu)[0]
    rows.append(check("in_proj (ColumnParallelLinear)", lambda t: layer.in_proj(t)[0], [x], runs, layer.in_proj))
    rows.append(check("fla causal_conv1d varlen", conv, [qkv, w] + ([] if b is None else [b.detach()]), runs))
    rows.append(check("q/k l2norm + split (jit_fuser)", lambda c: prepare(
        c, gate, beta, alpha, T, loc.qk, loc.v, loc.dk, loc.dv, loc.repeat, True, release_l2norm)[:3],
        [conv_out], runs))
    rows.append(check("gating g, beta (jit_fuser)", lambda a_log, dt, al, be: gb(a_log, dt, al, be),
                      [loc.A_log.detach(), loc.dt_bias.detach(), alpha_p, beta_p], runs))
    rows.append(check("fla chunk_gated_delta_rule varlen", lambda q_, k_, v_, g_, b_: chunk_gated_delta_rule(
        q_, k_, v_, g=g_, beta=b_, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
        cu_seqlens=pack.cu)[0], [q, k, v, g, beta_s], runs))
    rows.append(check("gated RMSNorm (release _apply_gated_norm)", lambda o, z: layer._apply_gated_norm(o, z),
                      [core, gate], runs, layer.out_norm))
    rows.append(check("out_proj (RowParallelLinear)", lambda t: layer.out_proj(t)[0],
                      [torch.randn(T, 1, loc.v, device="cuda", dtype=torch.bfloat16)], runs, layer.out_proj))
    rows.append(check("whole layer, THD, default mode", lambda t: layer(t, None, packed_seq_params=psp)[0], [x],
                      runs, layer))
    rows.append(check("whole layer, THD, deterministic_mode", lambda t: det(t, None, packed_seq_params=psp)[0],
                      [x], runs, det))
    return rows


if __name__ == "__main__":
    sys.exit(main())
