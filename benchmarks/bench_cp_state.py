"""CP that passes the state (gdn_cp_state, #56) against head-split CP and no CP, for the delta rule, on one GPU.

Until several GPUs are lent, each rank's share runs in turn on one GPU: its two slots of one document (T / cp tokens,
every head) through ``state_cp.local_pass`` and ``state_cp.corrected`` (fla's rule, forward + backward), the
all_gather replaced by the stack of every rank's final states computed in the same process. Against it: the rule on
the whole document with every head (no CP), and with ``heads / cp`` of them (head-split CP's per-rank work; its two
all-to-alls are counted in bytes, not run). Numerics: the state-passing output and the whole-document output, both
bf16, against fla's rule in fp32 on the whole document.

    python -m benchmarks.bench_cp_state --lengths 32768,131072 --cps 4 --json out.json

Prints one line per configuration; the JSON has every number. Conv, projections and norms are not included (their
per-rank cost is the same in both CP modes: T / cp tokens).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import torch
import torch.nn.functional as F

from gdn_compat.patches.gdn_thd import state_cp, state_steps
from gdn_compat.patches.gdn_thd.pack import host_pack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def decay_rates(heads: int) -> torch.Tensor:
    """Each head's decay scale, log-spaced from 1e-1 (forgets within a few hundred tokens) to 1e-3 (about e^-6.5 over
    8k tokens), inside the range of per-token decays megatron's A_log / dt_bias initialisation gives (about 1e-3 to
    1.6). With one rate of 1e-1 for every head (the first version) a slot of 4k tokens or more forgot its start state
    to an exact fp32 zero, so the forward's distance from fp32 could not see the states chained between ranks (it
    came out equal to the whole document's to the last digit)."""
    return torch.logspace(-1, -3, heads, device=DEVICE)


def inputs(t: int, heads: int, dk: int, dv: int, dtype, seed: int = 0) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    rand = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    return {"q": F.normalize(rand(1, t, heads, dk), dim=-1).to(dtype), "k": F.normalize(rand(1, t, heads, dk), dim=-1).to(dtype),
            "v": rand(1, t, heads, dv).to(dtype), "g": (-F.softplus(rand(1, t, heads)) * decay_rates(heads)).float(),
            "beta": rand(1, t, heads).sigmoid().to(dtype)}


def shard(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    chunks = x.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)


def unshard(parts: list[torch.Tensor], cp: int) -> torch.Tensor:
    slots: list = [None] * (2 * cp)
    for r, p in enumerate(parts):
        slots[r], slots[2 * cp - 1 - r] = p.chunk(2, dim=1)
    return torch.cat(slots, dim=1)


OOM = (torch.OutOfMemoryError, RuntimeError)  # Triton's launches raise RuntimeError("... out of memory")


def oom(e: Exception) -> dict:
    """{"oom": message} for an out-of-memory error; any other error is raised again."""
    if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e):
        raise e
    return {"oom": str(e).split(".")[0]}


def release() -> None:
    """Give a failed run's memory back. Called after the except block: inside it the traceback still holds the failed
    run's tensors (a 512k no-CP OOM had left head-split CP to OOM as well)."""
    if DEVICE == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def guarded(fn) -> dict:
    """{"ms", "peak_mib"} of ``timed(fn)``, or {"oom": message} where the GPU runs out of memory."""
    try:
        ms, peak = timed(fn)
    except OOM as e:
        failed = oom(e)
    else:
        return {"ms": ms, "peak_mib": peak / 2**20}
    release()
    return failed


def timed(fn, iters: int = 5) -> tuple[float, int]:
    """(ms per call, peak bytes above what was allocated before)."""
    if DEVICE != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3, 0
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, torch.cuda.max_memory_allocated() - base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--cps", default="4")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-numerics", action="store_true", help="skip the fp32 comparison (long documents)")
    ap.add_argument("--no-whole", action="store_true", help="skip the no-CP run (a document that does not fit)")
    ap.add_argument("--two-pass", action="store_true", help="also time the first version (a second run of the rule "
                                                             "from the chained states instead of the correction)")
    ap.add_argument("--no-steps", action="store_true", help="skip fla-core 0.4.2's chunk steps (state_steps.py)")
    ap.add_argument("--profile", action="store_true", help="print each state-passing variant's CUDA kernels by time")
    args = ap.parse_args()
    if DEVICE == "cuda":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        def rule(q, k, v, g, beta, initial_state, cu):  # fla reads these offsets on the host, in both modes alike
            offsets = torch.tensor(cu, dtype=torch.int32, device=q.device)
            return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial_state,
                                          output_final_state=True, use_qk_l2norm_in_kernel=False, cu_seqlens=offsets)
    else:  # a dry run of this script on the CPU: the release's torch rule, one slot at a time
        from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

        rule = state_cp.per_slot(torch_chunk_gated_delta_rule)
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "heads": args.heads,
               "dk": args.dk, "dv": args.dv, "rows": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    for length in [int(x) for x in args.lengths.split(",")]:
        d = inputs(length, args.heads, args.dk, args.dv, torch.bfloat16)
        for cp in [int(x) for x in args.cps.split(",")]:
            row = measure(rule, d, length, cp, args)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
        del d
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    save()


NAMES = ("q", "k", "v", "g", "beta")


def whole(rule, d: dict, heads: int | None = None) -> None:
    """The rule on the whole document (its first ``heads`` heads), forward + backward."""
    leaves = {n: t[:, :, :heads].detach().requires_grad_(True) for n, t in d.items()}
    o, _ = rule(*(leaves[n] for n in NAMES), None, [0, d["q"].shape[1]])
    o.backward(torch.ones_like(o))


def measure(rule, d: dict, length: int, cp: int, args) -> dict:
    t0 = time.perf_counter()

    def say(what: str) -> None:  # where it is (the first call of a shape compiles fla's kernels for minutes)
        print(f"  [{length} cp={cp} {time.perf_counter() - t0:.0f} s] {what}", file=sys.stderr, flush=True)

    say("every rank's final states")
    slots = [state_cp.Slots.of([length], cp, r) for r in range(cp)]
    local = [{n: shard(t, cp, r) for n, t in d.items()} for r in range(cp)]
    row: dict = {"length": length, "cp": cp}
    # numerics (forward): every rank's share, chained in process, against fp32 on the whole document
    with torch.no_grad():
        every = torch.stack([state_cp.local_pass(rule, *(x[n] for n in NAMES), s)[1] for x, s in zip(local, slots)])
        if not args.no_numerics:
            say("numerics against fp32")
            try:
                o_cp = unshard([state_cp.corrected(state_cp.local_pass(rule, *(x[n] for n in NAMES), s)[0], every, s)
                                for x, s in zip(local, slots)], cp)
                o_bf16, _ = rule(*(d[n] for n in NAMES), None, [0, length])
                truth, _ = rule(*(d[n].float() for n in NAMES), None, [0, length])
                row["rel_err_fp32"] = {"state_passing": rel(o_cp, truth), "whole_document": rel(o_bf16, truth)}
                del o_cp, o_bf16, truth
            except OOM as e:
                row["rel_err_fp32"] = oom(e)
            release()
    x0 = {n: t.detach().requires_grad_(True) for n, t in local[0].items()}

    def rank_step() -> None:  # rank 0's share, forward + backward (every rank's share is the same size)
        wide, own = state_cp.local_pass(rule, *(x0[n] for n in NAMES), slots[0])
        o = state_cp.corrected(wide, torch.cat([own[None], every[1:]]), slots[0])
        o.backward(torch.ones_like(o))

    def rank_step_two_pass() -> None:  # the first version: the rule run again from the chained start states
        _, own = state_cp.local_pass(rule, *(x0[n] for n in NAMES), slots[0])
        both = torch.cat([own[None], every[1:]])
        B, A = both.split([args.dv, args.dk], dim=-1)
        o, _ = rule(*(x0[n] for n in NAMES), state_cp.start_states(A, B, slots[0]), slots[0].cu)
        o.backward(torch.ones_like(o))

    say("state passing, one rank")
    row["state_passing_rank"] = guarded(rank_step)
    say(f"so far {json.dumps(row)}")
    variants = {"one_pass": rank_step}
    if DEVICE == "cuda" and not args.no_steps:
        say("state passing with fla's chunk steps (state_steps), one rank")
        steps_step, row["rel_err_fp32_steps"] = steps_rank(d, local, slots, length, cp, args)
        if steps_step is not None:
            row["state_passing_steps_rank"] = guarded(steps_step)
            variants["steps"] = steps_step
        say(f"so far {json.dumps(row)}")
    if args.profile and DEVICE == "cuda":
        for name, fn in variants.items():
            profile(name, fn)
    if args.two_pass:
        say("state passing in two passes (the first version), one rank")
        row["state_passing_two_pass_rank"] = guarded(rank_step_two_pass)
        say(f"so far {json.dumps(row)}")
    if not args.no_whole:
        say("no CP")
        row["no_cp"] = guarded(lambda: whole(rule, d))
    if args.heads % cp == 0:
        say("head-split CP, one rank")
        row["head_split_rank"] = guarded(lambda: whole(rule, d, args.heads // cp))
    # bytes a rank sends: state passing, its two slots' [B, A] in fp32 (the all_gather); head-split, q/k/v/z/b/a of
    # its T / cp tokens for the other ranks' heads (bf16) and its heads' outputs back (q/k counted at v's heads: a
    # GQA layer sends fewer)
    features = 2 * args.heads * args.dk + 2 * args.heads * args.dv + 2 * args.heads
    row["bytes_sent_per_rank"] = {
        "state_passing": 2 * args.heads * args.dk * (args.dk + args.dv) * 4,
        "head_split": (length // cp) * (features + args.heads * args.dv) * 2 * (cp - 1) // cp,
    }
    row["wall_s"] = time.perf_counter() - t0
    return row


def steps_rank(d: dict, local: list, slots: list, length: int, cp: int, args):
    """fla-core 0.4.2's chunk steps (``state_steps.FlaSteps``): (rank 0's share forward + backward, or None where the
    installed fla has not those steps; the forward's distance from fp32 with every rank chained in this process).
    The step's two all_gathers return rank 0's own part stacked with the other ranks' (their final states from this
    process; zeros for their start-state gradients: the time, not the values)."""
    from gdn_compat._probe.fla import state_steps as probe

    found, why = probe()
    if found.value != "yes":
        return None, {"skipped": why}
    scale = args.dk ** -0.5
    every_steps = [state_steps.FlaSteps(host_pack(s.cu, torch.device(DEVICE)), scale) for s in slots]
    err: dict = {}
    with torch.no_grad():
        ends = torch.stack([st.ends(*(x[n].contiguous() for n in NAMES))[0] for st, x in zip(every_steps, local)])
        if not args.no_numerics:
            dk = args.dk
            outs = []
            for st, x, s in zip(every_steps, local, slots):
                B, A = ends.split([ends.shape[-1] - dk, dk], dim=-1)
                xs = [x[n].contiguous() for n in NAMES]
                _, cache = st.ends(*xs)
                outs.append(st.run(*xs, state_cp.start_states(A, B, s).contiguous(), cache)[0])
            truth, _ = chunk_rule_fp32(d, length)
            err = {"state_passing_steps": rel(unshard(outs, cp), truth)}
            del outs, truth
    x0 = {n: t.detach().contiguous().requires_grad_(True) for n, t in local[0].items()}
    original = state_cp.gather

    def stand_in(x: torch.Tensor, group) -> torch.Tensor:  # the all_gather: rank 0's part, then the others'
        others = ends[1:] if x.shape == ends.shape[1:] else x.new_zeros(cp - 1, *x.shape)
        return torch.cat([x[None], others])

    def step() -> None:
        state_cp.gather = stand_in
        try:
            o = state_steps.delta_rule(every_steps[0], *(x0[n] for n in NAMES), slots[0], None)
            o.backward(torch.ones_like(o))
        finally:
            state_cp.gather = original

    return step, err


def chunk_rule_fp32(d: dict, length: int):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    offsets = torch.tensor([0, length], dtype=torch.int32, device=DEVICE)
    return chunk_gated_delta_rule(*(d[n].float() for n in ("q", "k", "v")), g=d["g"], beta=d["beta"].float(),
                                  use_qk_l2norm_in_kernel=False, cu_seqlens=offsets)


def profile(name: str, fn) -> None:
    """Print ``fn``'s CUDA kernels by total time (one call after a warm-up)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"[profile {name}]\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60),
          flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


if __name__ == "__main__":
    main()
