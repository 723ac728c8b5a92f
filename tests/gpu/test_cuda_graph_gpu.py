"""A packed GDN layer's forward+backward captured in one CUDA graph (#16, item 3): gdn_compat's packed
path makes no host sync once the pack is known, so torch.cuda.graph can record it (upstream's native
THD cannot: it reads the offsets on the host every call, #6796). Replays must equal eager bit for bit.
Timing is in benchmarks/bench_stack.py, not here."""

from __future__ import annotations

import pytest
import torch

import gdn_compat
from tests.support.gdn import QWEN3_NEXT, RL_LENGTHS, build_gdn, capture, offsets, packed, packed_run
from tests.support.release import FACTS, MEGATRON


def test_packed_layer_fwd_bwd_replays_from_a_cuda_graph_bitwise_eager(megatron_cpu):
    assert megatron_cpu == "cuda"
    if FACTS.gdn_thd != "refuses":
        pytest.skip(f"megatron-core {MEGATRON}: packed GDN is upstream's native path, which syncs on the host "
                    f"(upstream #6796); gdn_compat's graph-safe path is gdn_thd on 0.16/0.17")
    with gdn_compat.applied() as report:
        assert report["gdn_thd"].status == "applied"
        layer = build_gdn(device="cuda", dtype=torch.bfloat16, seed=2, **QWEN3_NEXT)
        gen = torch.Generator(device="cuda").manual_seed(9)
        x = torch.randn(sum(RL_LENGTHS), 1, QWEN3_NEXT["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        psp = packed(offsets(RL_LENGTHS))
        psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
        eager_out, eager_dx, eager_grads = packed_run(layer, x, psp, dy)
        graph, out, sx = capture(layer, x, dy, psp)
        for step in range(3):
            with torch.no_grad():  # new data into the static input: replay 1 sees zeros, then x
                sx.copy_(torch.zeros_like(x) if step == 0 else x)
            graph.replay()
        torch.cuda.synchronize()
        grads = {n: p.grad for n, p in layer.named_parameters()}
    differ = [k for k in eager_grads if not torch.equal(grads[k], eager_grads[k])]
    same = torch.equal(out, eager_out) and torch.equal(sx.grad, eager_dx) and not differ
    print(f"\n[cuda-graph {MEGATRON}] packed GDN fwd+bwd, {len(RL_LENGTHS)} sequences, {sum(RL_LENGTHS)} tokens: "
          f"replay vs eager {'bitwise equal' if same else f'differs (params {differ[:3]})'}")
    assert torch.equal(out, eager_out)
    assert torch.equal(sx.grad, eager_dx)
    assert not differ, differ
