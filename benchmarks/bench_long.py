"""Long documents and every layer shape (#37): one GDN layer, bf16, forward + backward, per configuration.

    python -m benchmarks.bench_long [--rows qwen3-next:32k,qwen3-next:128k,...] [--rounds 2] [--steps 5] [--json FILE]
                                    (repository root, one GPU; megatron-core 0.18/0.19 for the native default)

A row is a layer shape (SHAPES: the local key / value heads a rank's kernels see, tp shards included) and a pack
(PACKS: 16k tokens in 9 documents, an RL pack, 256 documents of 64 tokens, one document of 32k or 128k tokens).
Configurations (CONFIGS) are interleaved round by round within a row. Per row and configuration: wall ms (CUDA
events, median over rounds of each round's median), GPU kernel ms from torch.profiler (total, delta rule, gdn_compat's
fused kernels, GEMMs), peak memory of a step above its inputs and weights, the first call's seconds (compiles), and
whether FlashQLA's intra-card CP ran (``fused+flashqla/no-cp`` is both switches with it held off, to show what it
adds; ``.../graph-safe`` runs eagerly on a ``PackBuffer``'s offsets: what a captured step runs, with gdn_compat's own
choices for a pack it cannot read on the host; not in the default configs). A training process runs one layer shape
(every GDN layer of a model has the same heads) and many pack sizes, so compiled code is dropped
(``torch._dynamo.reset()``) where the layer shape changes between rows and kept where only the pack does: after a
second head count torch.compile recompiles a shared function with its head sizes symbolic, slower (measured: README).
gdn_compat's own compiled step now keeps one copy per layer shape; the release's compiled methods, which native runs,
are one function each (not measured in a mixed process). Each row is printed and written to the JSON as it completes,
so a run cut short keeps its finished rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import time
from unittest import mock

import torch

from benchmarks.bench_fast import NotTaken, kernels, timed
from tests.support.gdn import DESIGN_LENGTHS, LAYER_SHAPES, RL_LENGTHS, build_gdn, offsets, packed

SHAPES = LAYER_SHAPES  # name: (layer dims, key heads, value heads) as one rank's kernels see them
PACKS = {"16k": DESIGN_LENGTHS, "rl": RL_LENGTHS, "256x64": [64] * 256, "32k": [32768], "128k": [131072]}
CONFIGS = {"default": {}, "fused": {"gdn_fused": True}, "flashqla": {"gdn_flashqla": True},
           "fused+flashqla": {"gdn_fused": True, "gdn_flashqla": True},
           "fused+flashqla/no-cp": {"gdn_fused": True, "gdn_flashqla": True},
           "flashqla/graph-safe": {"gdn_flashqla": True},
           "fused+flashqla/graph-safe": {"gdn_fused": True, "gdn_flashqla": True}}
DEFAULT_CONFIGS = "default,fused,flashqla,fused+flashqla,fused+flashqla/no-cp"
ROWS = ("qwen3-next:16k,qwen3-next:rl,qwen3-next:256x64,qwen3-next:32k,qwen3-next:128k,qwen3.5:16k,qwen3.5:32k,"
        "qwen3.5:128k,qwen3-next-tp2:32k,qwen3-next-tp4:32k,qwen3-next-tp8:32k,qwen3.5-tp2:32k,qwen3.5-tp4:32k,"
        "qwen3.5-tp8:32k,ratio-3:32k")


@contextlib.contextmanager
def configured(name: str):
    import gdn_compat
    from gdn_compat.patches.gdn_thd import fast

    with contextlib.ExitStack() as stack:
        stack.enter_context(gdn_compat.applied(**CONFIGS[name]))
        if name.endswith("/no-cp"):
            stack.enter_context(mock.patch.object(fast, "flashqla_context", lambda pack, heads: None))
        yield


def row(shape: str, pack: str, configs: list[str], rounds: int, steps: int, said: NotTaken) -> dict:
    from gdn_compat.patches.gdn_thd import pack as P

    dims, hk, hv = SHAPES[shape]
    layer = build_gdn(device="cuda", dtype=torch.bfloat16, seed=0, hk=hk, hv=hv, **dims)
    lengths = PACKS[pack]
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(sum(lengths), 1, dims["hidden"], device="cuda", dtype=torch.bfloat16, generator=gen)
    x.requires_grad_(True)
    host = packed(offsets(lengths))
    host.cu_seqlens_q = host.cu_seqlens_kv = host.cu_seqlens_q.cuda()
    buffers: dict = {}

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x, None, packed_seq_params=buffers.get("now", host))[0].sum().backward()

    @contextlib.contextmanager
    def configured_row(name: str):
        with configured(name):
            if name.endswith("/graph-safe"):  # built under the config: a PackBuffer needs a packed path applied
                import gdn_compat.graphs

                buf = gdn_compat.graphs.PackBuffer(sum(lengths), len(lengths), device="cuda")
                buf.load(offsets(lengths))
                buffers["now"] = buf.params
            try:
                yield
            finally:
                buffers.pop("now", None)

    out: dict = {c: {"wall": []} for c in configs}
    for c in configs:  # first call (compiles of this shape), then the peak of a warm step
        P.PACKS.clear()  # a new pack: its CP decision is made (and logged) again
        said.clear()
        with configured_row(c):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            out[c]["first_call_s"] = round(time.perf_counter() - t0, 2)
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            out[c]["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
        out[c]["said"] = sorted(set(said.reasons))
        out[c]["intra_cp"] = any("intra-card CP for a pack" in s for s in said.reasons)  # flashqla_context's DEBUG
    for _ in range(rounds):
        for c in configs:
            with configured_row(c):
                out[c]["wall"].append(timed(step, steps))
    for c in configs:
        out[c]["wall_ms"] = round(statistics.median(out[c].pop("wall")), 3)
    for c in configs:  # last: torch.profiler leaves CUPTI attached, which slows every later launch's host side
        with configured_row(c):
            k = kernels(step)
        out[c]["kernels_ms"] = {key: k.get(key) for key in ("total", "delta rule", "fused (gdn_compat)", "gemm")}
        out[c]["top"] = k["top"]
    base_wall, base_k = out["default"]["wall_ms"], out["default"]["kernels_ms"]["total"]
    for c in configs:
        out[c]["speedup_wall"] = round(base_wall / out[c]["wall_ms"], 3)
        out[c]["speedup_kernels"] = round(base_k / out[c]["kernels_ms"]["total"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=ROWS, help="shape:pack,... of SHAPES and PACKS")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [r.split(":") for r in args.rows.split(",")]
    bad = [r for r in rows if len(r) != 2 or r[0] not in SHAPES or r[1] not in PACKS]
    if bad:
        ap.error(f"unknown rows {bad}: expected shape:pack of {sorted(SHAPES)} and {sorted(PACKS)}")
    configs = args.configs.split(",")
    if "default" not in configs:
        ap.error("--configs needs default (every speedup is against it)")
    from torch._dynamo import config as dynamo_config

    from tests.support.megatron import world

    setattr(dynamo_config, "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit", 64)
    said = NotTaken(also=("intra-card CP",))  # fallbacks, and the CP decisions (DEBUG)
    logging.getLogger("gdn_compat").addHandler(said)
    logging.getLogger("gdn_compat").setLevel(logging.DEBUG)
    result: dict = {"rows": {}}
    with world(cuda=True):
        import gdn_compat

        facts = gdn_compat.probe(init_cuda=True)
        result.update({"megatron_core": facts.megatron.version if facts.megatron else None, "fla": str(facts.fla),
                       "flashqla": str(facts.flashqla), "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(), "shapes": SHAPES, "packs": {k: len(v) for k, v in PACKS.items()}})
        for i, (shape, pack) in enumerate(rows):
            name = f"{shape}:{pack}"
            if i and shape != rows[i - 1][0]:  # a new layer shape: a process of its own would start here
                torch._dynamo.reset()
            result["rows"][name] = r = row(shape, pack, configs, args.rounds, args.steps, said)
            for c in configs:
                k = r[c]["kernels_ms"]
                print(f"[bench_long] {name:<22} {c:<21} wall {r[c]['wall_ms']:8.2f} ms ({r[c]['speedup_wall']:.2f}x)  "
                      f"kernels {k['total']:8.2f} ms ({r[c]['speedup_kernels']:.2f}x; delta rule {k['delta rule']}, "
                      f"fused {k['fused (gdn_compat)']}, gemm {k['gemm']})  peak {r[c]['peak_mib']} MiB  "
                      f"first {r[c]['first_call_s']} s  intra-CP {r[c]['intra_cp']}"
                      + (f"  said {r[c]['said']}" if r[c]["said"] and not r[c]["intra_cp"] else ""), flush=True)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(result, fh, indent=1)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
