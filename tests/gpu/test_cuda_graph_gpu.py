"""CUDA graphs of packed GDN steps that survive a new pack every step (#21, upstream #6796).

One capture per test; every layout below is loaded into the same ``PackBuffer`` and replayed, and each
replay must equal, bit for bit, the same step run eagerly through the same (graph-safe) path. The
graph-safe path itself is compared with the eager host path and, on 0.18/0.19, with native THD.
Timing is in benchmarks/bench_stack.py, not here."""

from __future__ import annotations

import pytest
import torch

import gdn_compat
from tests.support.gdn import QWEN3_NEXT, RL_LENGTHS, build_gdn, captured_layer_step, offsets, packed, packed_run, rel
from tests.support.release import FACTS, MEGATRON

T = sum(RL_LENGTHS)  # 8,393 tokens, at most 16 sequences: the RL pack's budget
LAYOUTS = {
    "rl pack": RL_LENGTHS,
    "one sequence fills the pack": [T],
    "length-1 sequences": [1] * 8 + [3000, 3000, T - 6008],
    "empty entries in the middle": [700, 0, 1500, 0, 0, 2000, T - 4200],  # load() pads the end with more
    "chunk edges": [1, 63, 64, 65, 127, 128, 129, 640, T - 1217],
    "rl pack again": RL_LENGTHS,
}


def _switch() -> dict:
    return {"gdn_thd_graph_safe": True} if FACTS.gdn_thd == "native" else {}


@pytest.fixture(autouse=True)
def recompile_limit(monkeypatch):
    """megatron's jit_fuser helpers recompile per shape and grad mode; past dynamo's limit of 8 (earlier
    tests in the process use it up) they run eager with other bits (see test_deterministic_gpu)."""
    from torch._dynamo import config

    monkeypatch.setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", 64)


@pytest.fixture
def graph_gdn(megatron_cpu):
    assert megatron_cpu == "cuda"
    if FACTS.gdn_thd not in ("native", "refuses"):
        pytest.skip(f"megatron-core {MEGATRON} has no GatedDeltaNet")
    with gdn_compat.applied(**_switch()) as report:
        assert {"gdn_thd", "gdn_thd_graph_safe"} & set(report.applied), report
        yield report


def _diff(got, want) -> dict[str, float]:
    """name -> relative error for every tensor that is not bitwise equal."""
    out = {}
    for name in want:
        if not torch.equal(got[name], want[name]):
            out[name] = rel(got[name], want[name])
    return out


def _as_dict(run) -> dict:
    out, dx, grads = run
    return {"out": out, "dx": dx, **grads}


def test_one_capture_of_a_packed_layer_replays_every_layout_bitwise_eager(graph_gdn):
    layer = build_gdn(device="cuda", dtype=torch.bfloat16, seed=2, **QWEN3_NEXT)
    gen = torch.Generator(device="cuda").manual_seed(9)
    xs = [torch.randn(T, 1, QWEN3_NEXT["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
          for _ in LAYOUTS]
    dy = torch.randn(T, 1, QWEN3_NEXT["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
    buf = gdn_compat.graphs.PackBuffer(T, 16, device="cuda")
    buf.load(offsets(RL_LENGTHS))
    graph, sx, static = captured_layer_step(layer, xs[0], dy, buf.params)
    report = []
    for (name, lengths), x in zip(LAYOUTS.items(), xs):
        cu = offsets(lengths)
        buf.load(cu)
        with torch.no_grad():
            sx.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        replay = {k: v.detach().clone() for k, v in static.items()}
        eager = _as_dict(packed_run(layer, x, buf.params, dy))  # the same path, not captured
        host = _as_dict(packed_run(layer, x, _host(cu), dy))
        differ, vs_host = _diff(replay, eager), _diff(eager, host)
        report.append(f"  {name:<30} replay vs eager: {'bitwise' if not differ else differ}; graph-safe vs host "
                      f"path: {'bitwise' if not vs_host else {k: f'{v:.1e}' for k, v in vs_host.items()}}")
        assert not differ, (name, differ)
        assert all(v < (3e-2 if k not in ("out", "dx") else 1e-2) for k, v in vs_host.items()), (name, vs_host)
    print(f"\n[cuda-graph {MEGATRON}] one capture of a packed GDN layer fwd+bwd ({T} tokens, <= 16 sequences):\n"
          + "\n".join(report))


def _host(cu: list[int]):
    """The same pack through the eager host path: empty entries dropped, device offsets."""
    psp = packed(sorted(set(cu)))
    psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
    return psp


def test_on_native_releases_the_graph_safe_path_equals_native_thd(megatron_cpu):
    if FACTS.gdn_thd != "native":
        pytest.skip(f"megatron-core {MEGATRON}: no native THD to compare with")
    layer = build_gdn(device="cuda", dtype=torch.bfloat16, seed=2, **QWEN3_NEXT)
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(T, 1, QWEN3_NEXT["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn_like(x)
    lines = []
    for name in ("rl pack", "length-1 sequences", "chunk edges"):
        cu = offsets(LAYOUTS[name])
        native = _as_dict(packed_run(layer, x, _host(cu), dy))
        with gdn_compat.applied(gdn_thd_graph_safe=True):
            host = _as_dict(packed_run(layer, x, _host(cu), dy))
            buf = gdn_compat.graphs.PackBuffer(T, 16, device="cuda")
            buf.load(cu)
            static = _as_dict(packed_run(layer, x, buf.params, dy))
        d_host, d_static = _diff(host, native), _diff(static, native)
        lines.append(f"  {name:<20} host path vs native: {'bitwise' if not d_host else d_host}; graph-safe (PackBuffer) "
                     f"vs native: {'bitwise' if not d_static else {k: f'{v:.1e}' for k, v in d_static.items()}}")
        assert not d_host, d_host  # the eager host path is native's kernels in native's order
        assert all(v < (3e-2 if k not in ("out", "dx") else 1e-2) for k, v in d_static.items()), d_static
    print(f"\n[graph-safe vs native {MEGATRON}]\n" + "\n".join(lines))


def test_one_capture_of_a_gdn_model_step_replays_new_packs_bitwise_eager(graph_gdn):
    from tests.support import model as M

    shape = dict(QWEN3_NEXT, ffn=4096)
    model = M.build(M.config(shape=shape, bf16=True, layers=2), seed=0, device="cuda")
    buf = gdn_compat.graphs.PackBuffer(T, 16, device="cuda")
    ids, pos, labels, mask = (torch.zeros(1, T, dtype=dt, device="cuda")
                              for dt in (torch.long, torch.long, torch.long, torch.float32))

    def load(lengths, seed):
        batch = M.packed_batch(lengths, None, seed=seed)
        buf.load(offsets(lengths))
        for static, key in ((ids, "ids"), (pos, "positions"), (labels, "labels"), (mask, "mask")):
            static.copy_(batch[key][None])

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, position_ids=pos, attention_mask=None, labels=labels,
                     packed_seq_params=buf.params)
        total = (loss.float() * mask).sum()
        total.backward()
        return total

    load(RL_LENGTHS, seed=1)
    graph, loss = gdn_compat.graphs.capture(step)
    static = {"loss": loss, **{n: p.grad for n, p in model.named_parameters()}}  # the graph's own tensors
    lines = []
    for i, (name, lengths) in enumerate(LAYOUTS.items()):
        load(lengths, seed=10 + i)
        graph.replay()
        torch.cuda.synchronize()
        replay = {k: v.detach().clone() for k, v in static.items()}
        eager_loss = step()
        eager = {"loss": eager_loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}
        differ = _diff(replay, eager)
        lines.append(f"  {name:<30} loss {replay['loss'].item():.4f}: replay vs eager "
                     f"{'bitwise' if not differ else differ}")
        assert not differ, (name, differ)
    print(f"\n[cuda-graph {MEGATRON}] one capture of a 2-layer GDN GPTModel step (loss, {len(eager) - 1} grads):\n"
          + "\n".join(lines))


def test_a_layout_the_capture_cannot_hold_is_refused_before_any_kernel(graph_gdn):
    buf = gdn_compat.graphs.PackBuffer(T, 16, device="cuda")
    with pytest.raises(ValueError, match="holds exactly 8393"):
        buf.load(offsets(RL_LENGTHS[:-1]))
    with pytest.raises(ValueError, match="holds at most 16"):
        buf.load(offsets([1] * 16 + [T - 16]))
