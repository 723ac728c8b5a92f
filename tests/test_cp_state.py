"""CP state passing (#56), the math: gdn_compat's conv with halos and delta rule with states chained across ranks,
each rank holding its load-balanced slots of every sequence, against a float64 run of each whole sequence.

2 and 4 gloo ranks (6 value heads at cp = 4: heads need not divide cp), a pack with a zero-length entry, a length-1
slot (shorter than the conv's halo, which then reaches back over several slots) and a sequence of one slot per rank.
Outputs and every input's gradient (summed over the ranks that hold a token: its own) must be as close to the float64
truth as the same rule over whole sequences on one rank (cp = 1) is.
"""

from __future__ import annotations

import inspect
import os
import tempfile
import types

import pytest
import torch
import torch.nn.functional as F

from gdn_compat._probe import Accepts
from gdn_compat.fused import reference as R
from gdn_compat.patches.gdn_thd import state_cp, state_steps
from tests.support.gdn import err_of, offsets, shard, unshard
from tests.support.release import FACTS, MEGATRON

# The math borrows only the release's torch rule: one release (0.19.2); the layer: one release per GDN generation
# (0.17.1: gdn_thd's packed path, 0.19.2: the native routes), as the other new multi-rank suites (#55's budget)
pytestmark = pytest.mark.heavy
ONE_RELEASE = pytest.mark.skipif(MEGATRON not in (None, "0.19.2"),
                                 reason=f"the CP state-passing math runs on one release (0.19.2), not {MEGATRON}")
PER_GENERATION = pytest.mark.skipif(MEGATRON not in (None, "0.17.1", "0.19.2"),
                                    reason=f"one release per GDN generation (0.17.1: gdn_thd, 0.19.2: the routes), "
                                           f"not {MEGATRON}")
LENGTHS = {2: [12, 0, 4, 40, 8], 4: [24, 0, 8, 64, 16]}  # slot lengths 3, -, 1, 10, 2 (cp 2) / 3, -, 1, 8, 2 (cp 4)
HEADS, DK, DV, WIDTH, CHANNELS = 6, 8, 4, 4, 10


def inputs(lengths: list[int], dtype=torch.float64) -> dict:
    gen = torch.Generator().manual_seed(sum(lengths))
    t = sum(lengths)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return {
        "q": R.l2norm(rand(t, HEADS, DK)), "k": R.l2norm(rand(t, HEADS, DK)), "v": rand(t, HEADS, DV),
        "g": -F.softplus(rand(t, HEADS)) * 0.3, "beta": rand(t, HEADS).sigmoid(), "do": rand(t, HEADS, DV),
        "x": rand(t, CHANNELS), "w": rand(CHANNELS, 1, WIDTH) * 0.5, "b": rand(CHANNELS), "dy": rand(t, CHANNELS),
    }


def whole(data: dict, lengths: list[int], rule) -> dict:
    """The rule and the conv over whole sequences (cp = 1): outputs and gradients."""
    leaves = {n: data[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "x", "w", "b")}
    o = rule(leaves, lengths)
    y = R.conv_act(leaves["x"], leaves["w"][:, 0], leaves["b"], offsets(lengths))
    ((o * data["do"].to(o)).sum() + (y * data["dy"].to(y)).sum()).backward()
    return {"o": o.detach(), "y": y.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def truth_rule(t: dict, lengths: list[int]) -> torch.Tensor:
    return R.delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], offsets(lengths))


def release_rule_whole(t: dict, lengths: list[int]) -> torch.Tensor:
    """The release's torch rule on each whole sequence, fp32: what cp = 1 runs on the CPU."""
    rule = release_torch_rule()
    outs, cu = [], offsets(lengths)
    for a, b in zip(cu, cu[1:]):
        if b > a:
            o, _ = rule(*(t[n][None, a:b].float() for n in ("q", "k", "v")), g=t["g"][None, a:b].float(),
                        beta=t["beta"][None, a:b].float(), use_qk_l2norm_in_kernel=False)
            outs.append(o[0])
    return torch.cat(outs)


def release_torch_rule():
    from megatron.core.ssm import gated_delta_net  # 0.19 imports it there from its common module

    return gated_delta_net.torch_chunk_gated_delta_rule


def _rank(rank: int, cp: int, port: int, path: str, lengths: list[int]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cp, init_method=f"tcp://127.0.0.1:{port}")
    try:
        data = inputs(lengths)
        slots = state_cp.Slots.of(lengths, cp, rank)
        mine = {n: shard(data[n], lengths, cp, rank).float().requires_grad_(True)
                for n in ("q", "k", "v", "g", "beta", "x")}
        w, b = data["w"].float().requires_grad_(True), data["b"].float().requires_grad_(True)
        rule = state_cp.per_slot(release_torch_rule())
        qkvgb = [mine[n][None] for n in ("q", "k", "v", "g", "beta")]
        o = state_cp.delta_rule(rule, *qkvgb, slots, dist.group.WORLD)[0]
        y = F.silu(state_cp.conv(mine["x"], w, b, slots, dist.group.WORLD))
        do = shard(data["do"], lengths, cp, rank).float()
        loss = (o * do).sum() + (y * shard(data["dy"], lengths, cp, rank).float()).sum()
        loss.backward()
        got = {"o": o.detach(), "y": y.detach(), **{f"d{n}": t.grad for n, t in mine.items()},
               "dw": w.grad, "db": b.grad}
        # the same rule as fla's steps run it (state_steps: transitions, start states, the rule from them; backward:
        # start-state gradients, final-state gradients chained back, the rule's backward), with the torch rule
        leaves = [t.detach().clone().requires_grad_(True) for t in qkvgb]
        o = state_steps.delta_rule(state_steps.TorchSteps(rule, slots), *leaves, slots, dist.group.WORLD)[0]
        (o * do).sum().backward()
        got.update({"steps o": o.detach(), **{f"steps d{n}": t.grad[0] for n, t in zip("q k v g beta".split(), leaves)}})
        every = [None] * cp
        dist.all_gather_object(every, got)
        if rank == 0:
            torch.save(every, path)
    finally:
        dist.destroy_process_group()


def test_a_length_that_is_not_a_multiple_of_2cp_is_refused_with_its_value():
    with pytest.raises(ValueError, match=r"sequence 1 of the pack has \(padded\) length 6; .* multiple of 2 x cp = 4"):
        state_cp.Slots.of([8, 6], 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_token_is_carried_by_the_start_state_of_its_own_slot(cp):
    """``carried`` batches slots of similar lengths (padding a short one): every token must still meet its own slot's
    start state. Against a loop over the slots; lengths from 1 to 40 tokens a slot, a zero-length entry."""
    lengths = [2 * cp * n for n in (40, 1, 0, 3, 17, 2, 9, 40, 5)]
    slots = state_cp.Slots.of(lengths, cp, cp - 1)
    cu = slots.cu
    gen = torch.Generator().manual_seed(cp)
    carry = torch.randn(cu[-1], HEADS, DK, generator=gen, dtype=torch.float64)
    start = torch.randn(len(cu) - 1, HEADS, DK, DV, generator=gen, dtype=torch.float64)
    want = torch.cat([torch.einsum("thk,hkv->thv", carry[a:b], start[p]) for p, (a, b) in enumerate(zip(cu, cu[1:]))])
    torch.testing.assert_close(state_cp.carried(carry, start, slots), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_final_state_gradients_chained_back_are_the_adjoint_of_the_start_states(cp):
    """``end_grads`` (state_steps' backward) against autograd through ``start_states`` (its forward): with each
    slot's start state weighted by ``D``, the gradient at a slot's final-state term ``B`` is what ``end_grads``
    gives that slot. Every rank of cp = 1, 2, 4; a pack of three sequences, float64."""
    lengths = [2 * cp * n for n in (3, 0, 5, 1)]
    gen = torch.Generator().manual_seed(cp)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    pieces = 2 * sum(1 for n in lengths if n)
    A, D = rand(cp, pieces, 2, DK, DK) * 0.5, rand(cp, pieces, 2, DK, DV)
    B = rand(cp, pieces, 2, DK, DV).requires_grad_(True)
    every = [state_cp.Slots.of(lengths, cp, r) for r in range(cp)]
    sum((state_cp.start_states(A, B, slots) * D[r]).sum() for r, slots in enumerate(every)).backward()
    for r, slots in enumerate(every):
        torch.testing.assert_close(state_cp.end_grads(A, D, slots), B.grad[r], rtol=1e-12, atol=1e-12)


# fla-core's chunk functions as their wheels define them (parameter names read from fla_core-0.4.2 and 0.5.0)
FLA_042 = {
    "chunk_gated_delta_rule_fwd": "q k v g beta scale initial_state output_final_state cu_seqlens cp_context "
                                  "chunk_indices transpose_state_layout",
    "chunk_gated_delta_rule_bwd": "q k v g beta A scale initial_state do dht cu_seqlens cp_context chunk_indices "
                                  "transpose_state_layout",
    "chunk_local_cumsum": "g chunk_size reverse scale cu_seqlens head_first output_dtype chunk_indices",
    "chunk_scaled_dot_kkt_fwd": "k g beta cu_seqlens chunk_size output_dtype chunk_indices",
    "solve_tril": "A cu_seqlens chunk_indices output_dtype",
    "recompute_w_u_fwd": "k v beta A g cu_seqlens chunk_indices",
    "chunk_gated_delta_rule_fwd_h": "k w u g gk initial_state output_final_state chunk_size save_new_value "
                                    "cu_seqlens cu_seqlens_cpu chunk_indices use_exp2 transpose_state_layout",
    "chunk_fwd_o": "q k v h g g_gamma scale cu_seqlens chunk_size chunk_indices transpose_state_layout",
    "chunk_bwd_dv_local": "q k do g g_gamma A scale cu_seqlens chunk_size chunk_indices",
    "chunk_gated_delta_rule_bwd_dhu": "q k w do dv g gk h0 dht scale cu_seqlens chunk_size chunk_indices use_exp2 "
                                      "transpose_state_layout",
    "chunk_bwd_dqkwg": "q k v do h dh w g g_gamma dv scale cu_seqlens chunk_size chunk_indices transpose_state_layout",
    "prepare_wy_repr_bwd": "k v beta A dw du g cu_seqlens chunk_indices",
}
FLA_050 = {**FLA_042, "chunk_gated_delta_rule_fwd": "q k v g beta scale initial_state output_final_state cu_seqlens "
                                                    "cp_context chunk_indices use_exp2 transpose_state_layout "
                                                    "use_gate_in_kernel A_log dt_bias"}


def chunk_module(signatures: dict) -> types.SimpleNamespace:
    def function(params: str):
        f = lambda *args, **kwargs: None  # noqa: E731
        f.__signature__ = inspect.Signature([inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                             for p in params.split()])
        return f

    return types.SimpleNamespace(**{name: function(params) for name, params in signatures.items()})


def test_the_fla_steps_are_taken_only_in_fla_core_0_4_2s_shape():
    """gdn_cp_state's fla path calls fla's chunk functions one by one, as 0.4.2's forward and backward call them:
    0.4.2's signatures pass; 0.5.0 (gates in base 2: use_exp2 in its forward), a step without a keyword it is handed,
    and the installed fla (0.6.0 in the test sessions: steps fused, state_v_first) are refused, saying why."""
    from gdn_compat._probe.fla import state_steps

    assert state_steps(chunk_module(FLA_042))[0] is Accepts.YES
    found, why = state_steps(chunk_module(FLA_050))
    assert found is Accepts.NO and "use_exp2" in why, why
    no_indices = {**FLA_042, "solve_tril": "A cu_seqlens output_dtype"}  # fla-core 0.4.1's solve_tril
    found, why = state_steps(chunk_module(no_indices))
    assert found is Accepts.NO and why == "its solve_tril lacks chunk_indices", why
    if FACTS.fla_varlen.rule is Accepts.YES and FACTS.fla and FACTS.fla.version.startswith("0.6"):
        found, why = state_steps()
        assert found is Accepts.NO and "state_v_first" in why, why
        assert FACTS.fla_varlen.state_steps is Accepts.NO and FACTS.notes["fla_state_steps"] == why


@ONE_RELEASE
@pytest.mark.skipif(FACTS.gdn == "absent", reason=f"{FACTS.release} has no GatedDeltaNet (its torch rule)")
@pytest.mark.parametrize("cp", [2, 4])
def test_state_passed_between_ranks_is_as_close_to_the_float64_truth_as_cp1(cp):
    from tests.support.megatron import free_port, spawn

    lengths = LENGTHS[cp]
    data = inputs(lengths)
    truth = whole(data, lengths, truth_rule)
    cp1 = whole({n: t.float() for n, t in data.items()}, lengths, release_rule_whole)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pt")
        spawn(_rank, (cp, free_port(), path, lengths), cp)
        every = torch.load(path)
    for name in ("o", "y", "dq", "dk", "dv", "dg", "dbeta", "dx", *(f"steps {n}" for n in "o dq dk dv dg dbeta".split())):
        got = unshard([e[name] for e in every], lengths, cp)
        want = name.removeprefix("steps ")
        err, base = err_of(got, truth[want]), err_of(cp1[want], truth[want])
        assert err <= 2 * base, f"cp {cp} {name}: {err:.2e} from the float64 truth; cp = 1: {base:.2e}"
    for name in ("dw", "db"):  # parameters: each rank's gradient is its tokens' part, summed as DP x CP does
        got = sum(e[name] for e in every)
        err, base = err_of(got, truth[name]), err_of(cp1[name], truth[name])
        assert err <= 2 * base, f"cp {cp} {name}: {err:.2e} from the float64 truth; cp = 1: {base:.2e}"


# The layer, as a user runs it: apply(gdn_cp_state=True), megatron's load-balanced THD shards with padding and a
# zero-length entry, 3 key / 9 value heads (neither divides cp = 2 or 4), deterministic_mode
# (the release's torch rule: what runs on a CPU)
LAYER = dict(hidden=32, dk=8, dv=8, hk=3, hv=9)  # divide neither cp = 2 nor cp = 4
LAYER_CFG = dict(dk=8, dv=8, hk=3, hv=9, kernel=4, eps=1e-5)
LAYER_PACKS = {2: ([0, 5, 20, 20, 27], [0, 8, 24, 24, 32]), 4: ([0, 5, 21, 21, 40], [0, 8, 24, 24, 48])}


def layer_case(cp: int):
    actual, padded = LAYER_PACKS[cp]
    lengths = [b - a for a, b in zip(padded, padded[1:])]
    spans = [(p, p + (b - a)) for p, a, b in zip(padded, actual, actual[1:])]  # each sequence's real tokens
    gen = torch.Generator().manual_seed(cp)
    x = torch.randn(padded[-1], 1, LAYER["hidden"], generator=gen)
    real = torch.zeros(padded[-1], dtype=torch.bool)
    for a, b in spans:
        real[a:b] = True
    dy = torch.randn(padded[-1], 1, LAYER["hidden"], generator=gen) * real[:, None, None]  # pads: no gradient
    return lengths, spans, x, dy, real


def _layer_rank(rank: int, cp: int, port: int, path: str) -> None:
    import gdn_compat
    from tests.support.gdn import build_gdn, packed, packed_run
    from tests.support.megatron import world

    with world(rank, cp, cp=cp, port=port), gdn_compat.applied(gdn_cp_state=True) as report:
        assert "gdn_cp_state" in report.applied, report
        lengths, _, x, dy, _ = layer_case(cp)
        m = build_gdn(deterministic=True, **LAYER)
        m.load_state_dict(torch.load(path)["state"])
        out, gx, grads = packed_run(m, shard(x, lengths, cp, rank), packed(*LAYER_PACKS[cp]),
                                    shard(dy, lengths, cp, rank))
        import torch.distributed as dist

        for g in grads.values():  # megatron sums parameter gradients over the context-parallel ranks
            dist.all_reduce(g)
        every = [None] * cp
        dist.all_gather_object(every, {"out": out, "gx": gx})
        if rank == 0:
            torch.save({"every": every, "grads": grads}, path)


@PER_GENERATION
@pytest.mark.skipif(FACTS.gdn == "absent", reason=f"{FACTS.release} has no GatedDeltaNet")
@pytest.mark.parametrize("cp", [2, 4])
def test_the_layer_with_gdn_cp_state_is_as_close_to_the_float64_truth_as_cp1(cp, megatron_cpu, monkeypatch):
    import gdn_compat
    from tests.support.gdn import build_gdn, packed, packed_run, reference_gdn, use_torch_l2norm
    from tests.support.megatron import free_port, spawn
    from tests.support.release import skip_reason

    why = skip_reason("gdn_cp_state", gdn_cp_state=True)
    if why:
        pytest.skip(f"gdn_cp_state not applied on {FACTS.release}: {why}")
    use_torch_l2norm(monkeypatch)
    lengths, spans, x, dy, real = layer_case(cp)
    m = build_gdn(deterministic=True, **LAYER)
    with gdn_compat.applied():  # cp = 1: the packed path the other suites hold to per-sequence runs
        out1, gx1, grads1 = packed_run(m, x, packed(*LAYER_PACKS[cp]), dy)
    # the float64 truth: every sequence alone, token by token
    params = {n: p.detach().double().requires_grad_(True) for n, p in m.named_parameters()}
    x64 = x[:, 0].double().requires_grad_(True)
    truth = reference_gdn(params, LAYER_CFG, x64, spans)
    (truth * dy[:, 0].double()).sum().backward()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pt")
        torch.save({"state": m.state_dict()}, path)
        spawn(_layer_rank, (cp, free_port(), path), cp)
        got = torch.load(path)
    out = unshard([e["out"][:, 0] for e in got["every"]], lengths, cp)
    gx = unshard([e["gx"][:, 0] for e in got["every"]], lengths, cp)
    pairs = {"output": (out[real], out1[:, 0][real], truth.detach()[real]), "input grad": (gx, gx1[:, 0], x64.grad)}
    pairs |= {f"{n} grad": (got["grads"][n], grads1[n], params[n].grad) for n in params}
    for what, (ours, one, want) in pairs.items():
        err, base = err_of(ours, want), err_of(one, want)
        assert err <= 2 * base, f"cp {cp} {what}: {err:.2e} from the float64 truth; cp = 1: {base:.2e}"
