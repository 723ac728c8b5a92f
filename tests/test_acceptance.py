"""End-to-end acceptance (#12): a GDN GPTModel built the way a user builds it trains on packed
micro-batches under tp, sp, cp and full recompute, on every release, against per-sequence runs.

Variants: one MTP layer (per-token MTP loss), and MoE MLPs (top-2 of 4 experts, no capacity limit
and no load-balancing loss, so a token's route does not depend on its neighbours).

The reference: the same weights at tp = cp = 1, every sequence run alone (unpacked, the release's
own GDN code), loss = sum of its per-token LM losses (plus its MTP loss, weighted as the pack's).
Each cell packs the same sequences (one pack of mixed lengths with a length-1 sequence; one padded
pack laid out by ``cu_seqlens_q_padded``),
runs forward + backward of the masked loss sum inside megatron-core's DistributedDataParallel,
finalises gradients with the release's own ``finalize_model_grads`` (as training does), gathers
tensor-parallel shards to full shape and compares every parameter gradient and every real token's
loss. fp32 on the CPU (gloo); bound: relative error (2-norm) <= 1e-5, GDN's
gate parameters (A_log, dt_bias) <= 1e-4 (see GATE_BOUND). Full recompute must give bitwise the
losses and gradients of no recompute.

The 1-rank cells run here; those that take two gloo ranks in tests/test_acceptance_two_ranks.py (same cells, bars
and helpers, a file of their own so that pytest-xdist runs the two side by side), and tp = 2 x cp = 2 in
tests/test_acceptance_four_ranks.py.

Known holes are strict expected failures naming the patch that closes them (each turns green
exactly when its patch applies):
- 0.18/0.19 run packed GDN only through fla's Triton kernels, and refuse THD in deterministic mode
  (the only mode their GDN runs on a CPU) unless ``gdn_thd_deterministic`` (#15) applies.
- tp = 2 without sequence parallelism, where ``gdn_out_norm_tp_grad`` (#14) is not applied: GDN's
  out_norm gradient is each rank's partial sum; every other gradient must match first.
"""

from __future__ import annotations

import os
import tempfile
from typing import NamedTuple

import pytest
import torch

import gdn_compat
from tests.support import model as M
from tests.support.gdn import use_short_chunks, use_torch_l2norm
from tests.support.release import FACTS, MEGATRON, skip_reason

pytestmark = [pytest.mark.skipif(FACTS.gdn == "absent", reason=f"{FACTS.release} has no GatedDeltaNet"),
              pytest.mark.heavy]

BOUND = 1e-5
# GDN's gate parameters: their gradient is a sum over every token and head with heavy cancellation
# (norm ~2e-3 from per-token terms ~1e-2), so fp32 rounding elsewhere in the pack (matmul blocking
# over 40 tokens instead of 7) shows up ~10x larger relative to it. Measured: 6.5e-5 on the padded
# pack at tp = 1 (absolute 2.6e-7, the same absolute error as the other layers' gates).
GATE_BOUND, GATES = 1e-4, ("self_attention.A_log", "self_attention.dt_bias")


# The 9-head state-passing cell's gates: 4.9e-4 measured (0.17.1 and 0.19.2, padded pack, layer 0; every other
# gradient within 1e-5). The reference shares cp = 1's rounding (the release's fp32 torch rule over each whole
# sequence), the state-passing rule rounds its own way (transitions chained across slots), and a sum of cancelling
# per-token terms magnifies the difference: cp = 1 on this shape is 2.8e-5 from the reference (layer 2: 1.1e-4).
# Which is nearer the truth is measured at the layer against float64 (tests/test_cp_state.py, 3 / 9 heads, cp = 2,
# checked 2026-12-06): state passing's A_log gradient 1.8e-6 from it, cp = 1's 6.2e-6. The tp = 2 x cp = 2 cell (2 key /
# 6 value heads): 1.7e-4 (dt_bias, layer 2, padded pack; 0.17.1 and 0.19.2 identical), where tp = 2 without CP on that
# shape is 3.4e-5 from the reference; every other gradient within 1e-5.
ODD_GATE_BOUND = 1e-3


def bound(name: str, cell: Cell | None = None) -> float:
    if name.endswith(GATES):
        return ODD_GATE_BOUND if cell is not None and cell.odd else GATE_BOUND
    return BOUND
PACKS = {"mixed": ([1, 7, 16, 3, 9], None), "padded": ([5, 13, 1, 6], [8, 16, 4, 8])}


class Cell(NamedTuple):
    """One configuration, run with and without full recompute."""

    tp: int
    sp: bool
    cp: int
    mtp: bool = False  # one MTP layer (its inner layer a GDN + MLP)
    moe: bool = False  # every second MLP a top-2 mixture of 4 experts
    fused: bool = False  # apply(gdn_fused=True): gdn_compat's Triton region (Triton's interpreter on the CPU)
    state: bool = False  # apply(gdn_cp_state=True): CP passes the delta rule's state between ranks (#56)
    odd: bool = False  # value heads per tensor-parallel rank that do not divide cp (the config too holds cp)

    def id(self, recompute: bool) -> str:
        return (f"tp{self.tp}-sp{'on' if self.sp else 'off'}-cp{self.cp}-{'full' if recompute else 'none'}"
                + "-mtp" * self.mtp + "-moe" * self.moe + "-fused" * self.fused + "-state" * self.state
                + f"-{self.shape()['hv']}heads" * self.odd)

    def shape(self) -> dict:
        if self.fused:
            return FUSED_SHAPE
        return (ODD_SHAPE if self.tp == 1 else ODD_TP_SHAPE) if self.odd else M.SHAPE

    def layers(self) -> int:
        return FUSED_LAYERS if self.fused else 4

    def reference(self) -> tuple:
        """The per-sequence reference this cell is held to: the model's MTP, MoE, heads and layers."""
        return self.mtp, self.moe, self.shape()["hk"], self.shape()["hv"], self.layers()

    def switches(self) -> dict:
        return ({"gdn_fused": True} if self.fused else {}) | ({"gdn_cp_state": True} if self.state else {})


# MTP cells at cp = 1 and without sp: the MTP layer's norms are megatron's torch norm, which refuses
# sequence parallelism without Transformer Engine. MoE cells: tp = 1 and tp = 2 with sp.
CELLS = [Cell(1, False, 1), Cell(2, False, 1), Cell(2, True, 1), Cell(1, False, 2),
         Cell(1, False, 1, mtp=True), Cell(2, False, 1, mtp=True), Cell(1, False, 1, moe=True),
         Cell(2, True, 1, moe=True)]
# gdn_fused under tp + sp, cp (after the all-to-all) and MTP, each with and without full recompute, in Triton's
# interpreter (minutes per release): on 0.17.1 (its route over gdn_thd) and 0.19.2 (over native THD), whose code
# paths the other releases of each generation share; tests/test_gdn_fused.py runs the layer on every release
FUSED = (skip_reason("gdn_fused", gdn_fused=True) is None and os.environ.get("TRITON_INTERPRET") == "1"
         and MEGATRON in ("0.17.1", "0.19.2"))
CELLS += [Cell(2, True, 1, fused=True), Cell(1, False, 2, fused=True), Cell(1, False, 1, mtp=True, fused=True)] * FUSED
# Their model is smaller (#55): the interpreter's cost is per program and op, not per element, and the kernels' grids
# and loops go over heads and blocks, so a cell costs ~heads x layers (the 4-layer, 4 / 8-head MTP cell with full
# recompute alone took 51 s). 2 layers (one layer's output feeds the next layer's region), 2 key / 6 value heads: the
# conv repeats each key head 3 times, tp = 2 and cp = 2 split both (one key, three value heads a rank). (2 / 4 heads
# gave gate gradients so cancelled that the unfused path too was 2.4e-3 from the reference under MTP: no measure.)
FUSED_SHAPE, FUSED_LAYERS = dict(M.SHAPE, hk=2, hv=6), 2
# gdn_cp_state: cp = 2 passing the state between the ranks. MTP at cp = 2 (either CP mode) only on 0.16: from 0.17 the
# release weights each rank's MTP loss by its own shard's real tokens over MTP targets, so under CP the objective is
# not cp = 1's (every gradient ~5e-2 off this reference, the same with the head all-to-all as with gdn_cp_state)
STATE = skip_reason("gdn_cp_state", gdn_cp_state=True) is None
MTP_CP = MEGATRON is not None and MEGATRON.startswith("0.16.")
CELLS += [Cell(1, False, 2, state=True)] * STATE + [Cell(1, False, 2, mtp=True)] * MTP_CP \
    + [Cell(1, False, 2, mtp=True, state=True)] * (STATE and MTP_CP)
# gdn_cp_state with heads that do not divide cp, configured as a user configures them (TransformerConfig at cp = 2:
# config_gdn_cp narrows 0.18/0.19's heads check to tp; 0.16/0.17 check tp alone)
ODD_SHAPE = dict(M.SHAPE, hk=3, hv=9)  # (3 / 3 gave a layer gate gradients of norm ~5e-6: no measure)
CELLS += [Cell(1, False, 2, state=True, odd=True)] * STATE
# tp = 2 x cp = 2 (four gloo ranks, tests/test_acceptance_four_ranks.py), one release per GDN generation (0.17.1:
# gdn_thd's all-to-all, 0.19.2: the release's own): the head all-to-all, and state passing with 2 key / 6 value heads,
# 1 / 3 per tensor-parallel rank, so its 3 value heads do not divide cp = 2
ODD_TP_SHAPE = dict(M.SHAPE, hk=2, hv=6)
FOUR = MEGATRON in ("0.17.1", "0.19.2")
CELLS += [Cell(2, True, 2)] * FOUR + [Cell(2, True, 2, state=True, odd=True)] * (FOUR and STATE)
OUT_NORM = "self_attention.out_norm.weight"
# 0.18/0.19 without gdn_thd_deterministic: upstream's packed path, CUDA + fla only
DETERMINISTIC_THD_HOLE = FACTS.gdn_thd == "native" and skip_reason("gdn_thd_deterministic") is not None


def _mtp_weight(real: int, targets: int) -> float:
    """What the release multiplies a micro-batch's summed MTP loss by (calculate_per_token_loss):
    0.16 nothing; 0.17+ its real tokens over its MTP targets (targets floored at 1)."""
    from packaging.version import Version

    return 1.0 if Version(MEGATRON) < Version("0.17") else real / max(targets, 1)


def _reference(path: str, cells) -> None:
    """Per-sequence runs of the tp = cp = 1 model, without and with MTP; saves weights, per-token
    losses and grads. With MTP each sequence's MTP gradient is rescaled from its own weight to the
    pack's (MTPLossAutoScaler's backward scale), so the sum over sequences is the pack's objective."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    out = {}
    shapes = {c.reference(): c.shape() for c in cells}
    for key in sorted(shapes):
        mtp, moe, layers = key[0], key[1], key[-1]
        model = M.build(M.config(deterministic=True, mtp=mtp, moe=moe, shape=shapes[key], layers=layers))
        ref = out[key] = {"state": {n: p.detach().clone() for n, p in model.named_parameters()}}
        for name, (lengths, padded) in PACKS.items():
            batch = M.packed_batch(lengths, padded)
            model.zero_grad(set_to_none=True)
            losses = torch.zeros(len(batch["ids"]))
            start, pack_weight = 0, _mtp_weight(sum(lengths), sum(lengths) - len(lengths))
            for n, slot in zip(lengths, batch["slots"]):
                sl = slice(start, start + n)
                MTPLossAutoScaler.set_loss_scale(torch.tensor(pack_weight / _mtp_weight(n, n - 1)))
                loss = model(input_ids=batch["ids"][sl][None], position_ids=batch["positions"][sl][None],
                             attention_mask=None, labels=batch["labels"][sl][None],
                             **({"loss_mask": torch.ones(1, n)} if mtp else {}))
                loss.sum().backward()
                losses[sl] = loss.detach()[0]
                start += slot
            MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
            ref[name] = {"loss": losses, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    torch.save(out, path)


def _run_cell(ref: dict, cell: Cell, recompute: bool, rank_tp: int, rank_cp: int, groups) -> dict:
    """One configuration on this rank, trained as Megatron trains: the model in megatron-core's
    DistributedDataParallel, the loss scaled by cp (as pretrain_gpt's loss_func does), gradients
    finalised by the release's own finalize_model_grads. Returns {pack: {"loss": rel, param: rel}}
    and, under "bits", every pack's losses and gradients as one flat tensor."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from tests.support.gdn import shard

    tp, sp, cp, mtp, moe = cell.tp, cell.sp, cell.cp, cell.mtp, cell.moe
    ref = ref[cell.reference()]
    cfg = M.config(tp=tp, sp=sp, cp=cp, recompute=recompute, deterministic=True, mtp=mtp, moe=moe, shape=cell.shape(),
                   layers=cell.layers())
    model = M.build(cfg)
    M.check_layout(model, tp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(M.split(name, ref["state"][name], tp, rank_tp, cell.shape()))
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    errors: dict = {"bits": {}, "calls": {"packed": 0, "fused": 0, "state": 0}}
    import gdn_compat.fused.region as fused_region  # the fused cells must really run gdn_compat's region
    import gdn_compat.patches.gdn_thd as thd
    from gdn_compat.patches.gdn_thd.kernels import Core  # and the state cells must pass the state

    def counting(kind, fn):
        def call(*args, **kwargs):
            errors["calls"][kind] += 1
            return fn(*args, **kwargs)
        return call
    for pack, (lengths, padded) in PACKS.items():
        batch = M.packed_batch(lengths, padded)
        if cp > 1 and any(s % (2 * cp) for s in batch["slots"]):
            continue
        slots = batch["slots"]
        local = (lambda t, slots=slots: shard(t, slots, cp, rank_cp)) if cp > 1 else (lambda t: t)
        ddp.zero_grad_buffer()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused_region, "region", counting("fused", fused_region.region))
            mp.setattr(thd, "packed_forward", counting("packed", thd.packed_forward))
            mp.setattr(Core, "state_passing", counting("state", Core.state_passing))
            loss = ddp(input_ids=local(batch["ids"])[None], position_ids=local(batch["positions"])[None],
                       attention_mask=None, labels=local(batch["labels"])[None], packed_seq_params=batch["psp"],
                       **({"loss_mask": local(batch["mask"])[None]} if mtp else {}))
            # per-token MTP loss (calculate_per_token_loss): DDP sums grads over cp instead of averaging
            ((loss[0] * local(batch["mask"])).sum() * (1 if mtp else cp)).backward()
        finalize_model_grads([ddp])
        real = local(batch["mask"]).bool()
        errs = {"loss": _rel(loss.detach()[0][real], local(ref[pack]["loss"])[real])}
        errors["bits"][pack] = torch.cat([loss.detach().flatten()] + [p.main_grad.flatten() for p in model.parameters()])
        for name, p in model.named_parameters():
            grad = p.main_grad.detach().clone()
            if tp > 1:
                shards = [torch.empty_like(grad) for _ in range(tp)]
                dist.all_gather(shards, grad, group=groups["tp"])
                grad = M.join(name, shards, cell.shape())
            errs[name] = _rel(grad, ref[pack]["grads"][name])
        errors[pack] = errs
    return errors


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _worker(rank: int, world: int, port: int, ref_path: str, out_path: str, cells) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.support.megatron import world as megatron_world

    results = {}
    with megatron_world(rank, world, port=port), pytest.MonkeyPatch.context() as mp:
        use_torch_l2norm(mp)
        use_short_chunks(mp)
        ref = torch.load(ref_path)
        for cell, recompute in cells:
            tp, cp = cell.tp, cell.cp
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
            groups = {"tp": parallel_state.get_tensor_model_parallel_group(),
                      "cp": parallel_state.get_context_parallel_group()}
            with gdn_compat.applied(**cell.switches()):
                try:
                    results[cell.id(recompute)] = _run_cell(
                        ref, cell, recompute, parallel_state.get_tensor_model_parallel_rank(),
                        parallel_state.get_context_parallel_rank(), groups)
                except Exception as exc:  # noqa: BLE001 - reported per cell
                    results[cell.id(recompute)] = f"{type(exc).__name__}: {exc}"
            dist.barrier()
    if rank == 0:
        torch.save(results, out_path)


def one_rank_cells() -> list:
    return [c for c in CELLS if c.tp * c.cp == 1]


def two_rank_cells() -> list:
    """Run by tests/test_acceptance_two_ranks.py (its own file, so that pytest-xdist runs it beside this one)."""
    return [c for c in CELLS if c.tp * c.cp == 2]


def four_rank_cells() -> list:
    """Run by tests/test_acceptance_four_ranks.py."""
    return [c for c in CELLS if c.tp * c.cp == 4]


def ids(cells) -> list[str]:
    return [c.id(False).replace("-none", "") for c in cells]


def spawned(cells, ranks: int) -> dict:
    """Every cell's worst errors (with and without full recompute), from one spawn of ``ranks`` gloo ranks."""
    from tests.support.megatron import free_port, spawn

    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "out.pt")
        runs = [(c, r) for c in cells for r in (False, True)]
        spawn(_worker, (ranks, free_port(), reference_path(tmp, cells), out_path, runs), ranks)
        return torch.load(out_path)


def reference_path(tmp: str, cells) -> str:
    """The per-sequence reference of ``cells``, saved under ``tmp``."""
    with pytest.MonkeyPatch.context() as patcher:
        use_torch_l2norm(patcher)
        use_short_chunks(patcher)
        path = os.path.join(tmp, "ref.pt")
        _reference(path, cells)
    return path


@pytest.fixture(scope="module")
def matrix(megatron_cpu):
    """Every 1-rank cell's worst errors, run in this process."""
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patcher:
        use_torch_l2norm(patcher)
        use_short_chunks(patcher)
        ref = torch.load(reference_path(tmp, one_rank_cells()))
        from megatron.core import parallel_state

        groups = {"tp": parallel_state.get_tensor_model_parallel_group(),
                  "cp": parallel_state.get_context_parallel_group()}
        results = {}
        for cell in one_rank_cells():
            for recompute in (False, True):
                with gdn_compat.applied(**cell.switches()):
                    try:
                        results[cell.id(recompute)] = _run_cell(ref, cell, recompute, 0, 0, groups)
                    except Exception as exc:  # noqa: BLE001
                        results[cell.id(recompute)] = f"{type(exc).__name__}: {exc}"
    return results


def judge_training_step(matrix: dict, cell: Cell, recompute: bool) -> None:
    got = matrix[cell.id(recompute)]
    where = f"{MEGATRON} {cell.id(recompute)}"
    if DETERMINISTIC_THD_HOLE:
        assert isinstance(got, str), f"{where}: packed GDN ran on the CPU; drop this expected failure"
        assert "Packed sequence does not support deterministic mode" in got, f"{where}: another failure: {got}"
        pytest.xfail(f"{where}: {got[:160]} -- needs gdn_thd_deterministic (#15)")
    assert not isinstance(got, str), f"{where}: {got}"
    # every packed GDN call of a fused cell (each layer's, the MTP layer's, recompute's) runs the fused region, and
    # no other cell's does
    calls = got["calls"]
    assert calls["fused"] == (calls["packed"] if cell.fused else 0) and (calls["packed"] > 0 or not cell.fused), \
        f"{where}: {calls}"
    # and every packed GDN call of a gdn_cp_state cell passes the state between the ranks, and no other cell's does
    assert calls["state"] == (calls["packed"] if cell.state else 0) and (calls["packed"] > 0 or not cell.state), \
        f"{where}: {calls}"
    got = {pack: errs for pack, errs in got.items() if pack not in ("bits", "calls")}
    worst = {pack: max((v, k) for k, v in errs.items() if not k.endswith(OUT_NORM)) for pack, errs in got.items()}
    print(f"\n[acceptance {where}] worst rel error (excluding out_norm): "
          + ", ".join(f"{p} {v:.1e} ({k})" for p, (v, k) in worst.items()))
    for pack, errs in got.items():
        bad = {k: v for k, v in errs.items() if v > bound(k, cell) and not k.endswith(OUT_NORM)}
        assert not bad, f"{where} {pack}: {bad}"
    out_norm = {f"{pack} {k}": v for pack, errs in got.items() for k, v in errs.items() if k.endswith(OUT_NORM)}
    if cell.tp > 1 and not cell.sp and skip_reason("gdn_out_norm_tp_grad") is not None:
        assert max(out_norm.values()) > BOUND, f"{where}: the #14 hole was expected but out_norm matched"
        pytest.xfail(f"{where}: out_norm grad is the rank's partial sum (worst rel {max(out_norm.values()):.2f}) "
                     f"-- needs gdn_out_norm_tp_grad (#14)")
    print(f"[acceptance {where}] out_norm worst rel error {max(out_norm.values()):.1e}")
    assert max(out_norm.values()) <= BOUND, f"{where}: {out_norm}"


def judge_full_recompute(matrix: dict, cell: Cell) -> None:
    """Every real token's loss and every gradient (this rank's shard), packed, with and without full
    recompute (for MTP on 0.16/0.17 through mtp_checkpoint_args, on 0.18 mtp_padding_mask)."""
    plain, full = matrix[cell.id(False)], matrix[cell.id(True)]
    if DETERMINISTIC_THD_HOLE:
        pytest.xfail(f"{MEGATRON}: packed GDN does not run here -- needs gdn_thd_deterministic (#15)")
    assert not isinstance(plain, str) and not isinstance(full, str), (plain, full)
    for pack, bits in plain["bits"].items():
        assert torch.equal(bits, full["bits"][pack]), f"{MEGATRON} {cell.id(True)} {pack}: differs from no recompute"


@pytest.mark.parametrize("recompute", [False, True], ids=["recompute-none", "recompute-full"])
@pytest.mark.parametrize("cell", one_rank_cells(), ids=ids(one_rank_cells()))
def test_packed_training_step_matches_per_sequence_runs(matrix, cell, recompute):
    judge_training_step(matrix, cell, recompute)


@pytest.mark.parametrize("cell", one_rank_cells(), ids=ids(one_rank_cells()))
def test_full_recompute_is_bitwise_no_recompute(matrix, cell):
    judge_full_recompute(matrix, cell)
