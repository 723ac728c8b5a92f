"""GDN forward+backward at Qwen3-Next size (design.md section 5): packed THD (the shim on 0.16/0.17,
native on 0.18+), packed THD in deterministic_mode (gdn_compat on every release; also its pure-torch
per-sequence core, the path before fla's kernels were measured deterministic), right-padded BSHD,
and one call per sequence. Median of 5 after warm-up, peak
memory above the inputs, host syncs per THD layer call with the pack already known.

    python -m benchmarks.bench_gdn_thd [--json-dir DIR]     (from the repository root)
    writes DIR/bench-<megatron-core>.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from tests.support.gdn import DESIGN_LENGTHS as LENGTHS
from tests.support.gdn import QWEN3_NEXT as SHAPE
from tests.support.gdn import build_gdn, host_syncs, offsets, packed


def measure(step, reps=5, warmup=2):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json-dir", default=None)
    args = parser.parse_args()
    from tests.support.megatron import world

    with world(cuda=True):
        run(args)


def run(args):
    import gdn_compat

    report = gdn_compat.apply()
    facts = report.facts
    native = facts.gdn_thd == "native"
    thd_label = "THD native" if native else f"THD shim ({report['gdn_thd'].status})"
    m = build_gdn(device="cuda", dtype=torch.bfloat16, **SHAPE)
    T, H = sum(LENGTHS), SHAPE["hidden"]
    cu = offsets(LENGTHS)
    x = torch.randn(T, 1, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    psp = packed(cu)
    psp.cu_seqlens_q = psp.cu_seqlens_kv = psp.cu_seqlens_q.cuda()
    xp = torch.zeros(max(LENGTHS), len(LENGTHS), H, device="cuda", dtype=torch.bfloat16)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        xp[: b - a, i] = x.detach()[a:b, 0]
    xp.requires_grad_(True)
    pieces = [x.detach()[a:b].clone().requires_grad_(True) for a, b in zip(cu, cu[1:])]
    det = build_gdn(device="cuda", dtype=torch.bfloat16, deterministic=True, **SHAPE)
    det.load_state_dict(m.state_dict())
    torch_core = _torch_core(facts, m)

    def thd():
        m(x, None, packed_seq_params=psp)[0].sum().backward()

    def thd_det():
        det(x, None, packed_seq_params=psp)[0].sum().backward()

    def thd_det_torch():
        from gdn_compat.patches.gdn_thd import pack_of, packed_forward

        packed_forward(det, torch_core, x, pack_of(det, x, psp, 1), 1)[0].sum().backward()

    def padded():
        m(xp, None)[0].sum().backward()

    def per_seq():
        for p in pieces:
            m(p, None)[0].sum().backward()

    rows = {}
    steps = ((thd_label, thd), ("THD deterministic (gdn_compat)", thd_det),
             ("THD deterministic, torch core", thd_det_torch), ("padded BSHD", padded), ("per-sequence loop", per_seq))
    for label, step in steps:
        ms, mib = measure(step)
        rows[label] = {"ms": round(ms, 2), "peak_mib": round(mib, 1)}
    rows[thd_label]["syncs_per_call"] = len(host_syncs(thd))
    rows["THD deterministic (gdn_compat)"]["syncs_per_call"] = len(host_syncs(thd_det))
    ref = rows[thd_label]["ms"]
    mc = facts.megatron.version if facts.megatron else None
    print(f"megatron-core {mc}, {facts.fla}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'mode':<32}{'ms':>8}{'vs THD':>8}{'peak MiB':>10}{'syncs':>7}")
    for label, r in rows.items():
        print(f"{label:<32}{r['ms']:>8.2f}{r['ms'] / ref:>7.2f}x{r['peak_mib']:>10.0f}{r.get('syncs_per_call', ''):>7}")
    if args.json_dir:
        with open(os.path.join(args.json_dir, f"bench-{mc}.json"), "w") as fh:
            json.dump({"megatron_core": mc, "fla": str(facts.fla), "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(), "lengths": LENGTHS, "rows": rows}, fh, indent=1)


def _torch_core(facts, layer):
    """gdn_compat's pure-torch per-sequence core (what deterministic THD ran before fla's kernels were
    measured deterministic), bound to this release's module."""
    import sys

    from gdn_compat._probe import Accepts
    from gdn_compat.patches.gdn_thd.kernels import Core

    return Core(sys.modules[type(layer).forward.__module__], facts.fla_varlen, Accepts.NO)


if __name__ == "__main__":
    main()
