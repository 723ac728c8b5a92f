"""gdn_fused and gdn_flashqla against the release's default path (#30): one GDN layer at Qwen3-Next size, bf16,
forward + backward, and bench_graphs' 8-layer stack. One process; the configurations are interleaved round by
round (each round: every configuration, median of --steps steps), so clocks and thermals hit them alike.

    python -m benchmarks.bench_fast [--rounds 3] [--steps 5] [--json FILE] [--no-stack] [--no-peak] [--no-layer]
                                    [--configs default,fused,flashqla,fused+flashqla]   (repository root)

Per configuration and pack (16k = design.md's 9 sequences, rl = 16 sequences, 8,393 tokens):
* wall: eager forward + backward, CUDA events, median over rounds of each round's median;
* GPU kernel time per step from torch.profiler, by kind (GEMMs, delta rule, fla conv, gdn_compat's fused
  kernels, l2norm, copies, other);
* first call: seconds for the first forward + backward of that configuration in the process (compiles);
* activation bytes per token: the storages autograd saved in one forward, counted once each;
* peak memory of one layer at 64k tokens above the inputs.
Stack: 8-layer GDN + SwiGLU GPTModel, rl budget (10,240 tokens, a new random layout every step): default eager
vs each fast configuration eager and in one CUDA-graph capture replayed for every layout.
Every wall clock is taken before the kernel profiles: once torch.profiler has run in a process, CUPTI stays
attached and adds host time to every launch (runs before 2026-12-02 timed the stack after the profiles, and
their eager stack rows read ~20 ms high: 121.5-126.6 ms for the default against 102.0 ms in bench_graphs).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import statistics
import time

import torch

from benchmarks.bench_gdn_thd import measure
from tests.support.gdn import DESIGN_LENGTHS, QWEN3_NEXT, RL_LENGTHS, build_gdn, offsets, packed

PACKS = {"16k": DESIGN_LENGTHS, "rl": RL_LENGTHS}
CONFIGS = {"default": {}, "fused": {"gdn_fused": True}, "flashqla": {"gdn_flashqla": True},
           "fused+flashqla": {"gdn_fused": True, "gdn_flashqla": True}}
KINDS = (("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_")),
         ("fused (gdn_compat)", ("_conv_fwd", "_conv_bwd", "_gate_fwd", "_gate_bwd", "_norm_fwd", "_norm_bwd")),
         ("conv (fla)", ("causal_conv1d",)),
         ("delta rule", ("chunk", "wy_repr", "solve_tril", "recompute_w_u", "kkt", "gdr", "tilelang", "group_reduce",
                         "cumsum", "fwd_h", "dhu", "dqkwg", "bwd_dv", "fwd_o")),
         ("l2norm", ("l2norm", "l2_norm")),
         ("copies", ("copy", "Copy", "Cat", "cat_", "memcpy", "Memcpy", "index")))


def kind(name: str) -> str:
    for label, keys in KINDS:
        if any(k in name for k in keys):
            return label
    return "other"


def cuda_psp(lengths):
    """A ``PackedSeqParams`` of ``lengths`` with its offsets on the GPU."""
    psp = packed(offsets(lengths))
    psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
    return psp


def timed(step, steps: int) -> float:
    """Median ms of ``steps`` runs (bench_gdn_thd's measure, the shapes already warm)."""
    return measure(step, steps, warmup=0)[0]


def kernels(step, steps: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_kind: dict = collections.Counter()
    top: dict = collections.Counter()
    other: dict = collections.Counter()
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            by_kind[kind(ev.name)] += us / 1000 / steps
            top[ev.name[:60]] += us / 1000 / steps
            if kind(ev.name) == "other":
                other[ev.name[:60]] += us / 1000 / steps
    total = sum(by_kind.values())
    return {"total": round(total, 3), **{k: round(v, 3) for k, v in sorted(by_kind.items())},
            "top": {k: round(v, 3) for k, v in top.most_common(12)},
            "top other": {k: round(v, 3) for k, v in other.most_common(8)}}


def saved_bytes_per_token(layer, x, psp) -> float:
    seen: dict = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, None, packed_seq_params=psp)[0]
    del out
    return sum(seen.values()) / x.shape[0]


def layer_rows(rounds: int, steps: int, configs: dict) -> dict:
    import gdn_compat

    layer = build_gdn(device="cuda", dtype=torch.bfloat16, seed=0, **QWEN3_NEXT)
    data = {}
    for name, lengths in PACKS.items():
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(sum(lengths), 1, QWEN3_NEXT["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
        data[name] = (x.requires_grad_(True), cuda_psp(lengths))

    def step_of(pack):
        x, psp = data[pack]

        def step():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x, None, packed_seq_params=psp)[0].sum().backward()
        return step

    rows: dict = {c: {"first_call_s": None, "packs": {p: {"wall": []} for p in PACKS}} for c in configs}
    for cfg, switches in configs.items():  # first calls, in this order, each in this fresh process
        with gdn_compat.applied(**switches):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step_of("16k")()
            torch.cuda.synchronize()
            rows[cfg]["first_call_s"] = round(time.perf_counter() - t0, 1)
            for pack in PACKS:
                step_of(pack)()  # warm every shape
    for _ in range(rounds):
        for cfg, switches in configs.items():
            with gdn_compat.applied(**switches):
                for pack in PACKS:
                    rows[cfg]["packs"][pack]["wall"].append(timed(step_of(pack), steps))
    for cfg, switches in configs.items():
        with gdn_compat.applied(**switches):
            for pack in PACKS:
                r = rows[cfg]["packs"][pack]
                r["wall_ms"] = round(statistics.median(r.pop("wall")), 3)
                x, psp = data[pack]
                r["saved_bytes_per_token"] = round(saved_bytes_per_token(layer, x, psp))
    for cfg in configs:
        for pack in PACKS:
            base = rows["default"]["packs"][pack]["wall_ms"]
            rows[cfg]["packs"][pack]["speedup"] = round(base / rows[cfg]["packs"][pack]["wall_ms"], 3)

    def profile() -> None:
        """Each configuration's kernel times, added to ``rows``: called after every wall-clock measurement of the
        process, because once torch.profiler has run, CUPTI stays attached and adds host time to every launch."""
        for cfg, switches in configs.items():
            with gdn_compat.applied(**switches):
                for pack in PACKS:
                    rows[cfg]["packs"][pack]["kernels_ms"] = kernels(step_of(pack))

    return rows, profile


def peak_rows(configs: dict, tokens: int = 65536) -> dict:
    import gdn_compat

    layer = build_gdn(device="cuda", dtype=torch.bfloat16, seed=0, **QWEN3_NEXT)
    lengths = [tokens - 4096 - 8192, 8192, 4096]
    x = torch.randn(tokens, 1, QWEN3_NEXT["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    psp = cuda_psp(lengths)
    out = {}
    for cfg, switches in configs.items():
        with gdn_compat.applied(**switches):
            def step():
                layer.zero_grad(set_to_none=True)
                x.grad = None
                layer(x, None, packed_seq_params=psp)[0].sum().backward()
            step()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            out[cfg] = {"peak_mib": round((torch.cuda.max_memory_allocated() - base) / 2**20),
                        "wall_ms": round(timed(step, 3), 2)}
    return out


class NotTaken(logging.Handler):
    """The fast paths a configuration's calls did not take, and why (gdn_compat warns once per process and reason:
    ``clear`` forgets what was said, so every configuration's reasons are logged again)."""

    def __init__(self, also: tuple[str, ...] = ()):
        super().__init__()
        self.reasons: list[str] = []
        self.keys = ("not used for a packed GDN call", *also)  # ``also``: other lines to collect

    def emit(self, record: logging.LogRecord) -> None:
        if any(k in record.getMessage() for k in self.keys):
            self.reasons.append(record.getMessage())

    def clear(self) -> None:
        from gdn_compat.patches.gdn_thd import fast

        fast.forget_notes()
        self.reasons = []


def stack_rows(reps: int, configs: dict) -> dict:
    """The 8-layer stack per configuration; each row lists the fast paths its calls did not take. (Before
    2026-12-02 the stack's GDN out_norm, tests.support.model.SPNorm, was a plain Module that the fused norm does not
    know, so the gdn_fused rows of those runs ran the unfused path; it is a torch.nn.RMSNorm now.)"""
    import gdn_compat
    from benchmarks.bench_graphs import STACK_SHAPE, rows_for
    from tests.support import model as M

    model = M.build(M.config(shape=STACK_SHAPE, bf16=True, layers=8), seed=0, device="cuda")
    watch = NotTaken()
    log = logging.getLogger("gdn_compat")
    log.addHandler(watch)
    rows = {}
    try:
        for cfg, switches in configs.items():
            graphed = cfg != "default"  # the default path on 0.18/0.19 is native (host reads): not capturable
            watch.clear()
            with gdn_compat.applied(**switches):
                got = rows_for(model, "rl", reps, graphed)
            for row in got.values():
                row["paths_not_taken"] = sorted(set(watch.reasons))
            if switches and watch.reasons:
                print(f"  WARNING {cfg}: a fast path was not taken: {sorted(set(watch.reasons))}")
            rows.update({f"{cfg}: {k}": v for k, v in got.items()})
            for k, v in got.items():
                print(f"  [stack] {cfg}: {k}: {v['ms']:.2f} ms", flush=True)
            torch.cuda.empty_cache()
    finally:
        log.removeHandler(watch)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--no-stack", action="store_true")
    ap.add_argument("--no-peak", action="store_true")
    ap.add_argument("--no-layer", action="store_true", help="only the 64k peak and the stack")
    args = ap.parse_args()
    from torch._dynamo import config as dynamo_config

    from tests.support.megatron import world

    setattr(dynamo_config, "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit", 64)
    configs = {k: CONFIGS[k] for k in args.configs.split(",")}
    result: dict = {}
    with world(cuda=True):
        import gdn_compat

        facts = gdn_compat.probe(init_cuda=True)
        if facts.flashqla is None:
            configs = {k: v for k, v in configs.items() if "gdn_flashqla" not in v}
        profile = None
        if not args.no_layer:
            result["layer"], profile = layer_rows(args.rounds, args.steps, configs)
        if not args.no_peak:
            result["peak_64k"] = peak_rows(configs)
            print("one layer at 64k tokens:", json.dumps(result["peak_64k"]))
        if not args.no_stack:
            with contextlib.suppress(torch.cuda.OutOfMemoryError):
                result["stack"] = stack_rows(20, configs)
        if profile is not None:
            profile()  # last: no wall clock after it
            _print_layer(result["layer"])
    mc = facts.megatron.version if facts.megatron else None
    result.update({"megatron_core": mc, "fla": str(facts.fla), "flashqla": str(facts.flashqla), "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(), "packs": PACKS})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


def _print_layer(rows: dict) -> None:
    print(f"{'config':<16}{'pack':<6}{'wall ms':>9}{'x':>7}{'kernels':>9}{'first s':>9}{'B/token':>9}  by kind")
    for cfg, r in rows.items():
        for pack, p in r["packs"].items():
            k = {a: b for a, b in p["kernels_ms"].items() if a not in ("total", "top")}
            print(f"{cfg:<16}{pack:<6}{p['wall_ms']:>9.2f}{p['speedup']:>6.2f}x{p['kernels_ms']['total']:>9.2f}"
                  f"{r['first_call_s']:>9}{p['saved_bytes_per_token']:>9}  {k}")


if __name__ == "__main__":
    main()
