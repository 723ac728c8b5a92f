"""The acceptance cells of tests/test_acceptance.py that take two gloo ranks (tp = 2 with and without sequence
parallelism, with MTP and MoE; cp = 2; their gdn_fused cells): the same model, reference and bars, in a file of
their own so that pytest-xdist runs them beside the 1-rank cells."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.support.release import FACTS
from tests.test_acceptance import (
    _worker,
    ids,
    judge_full_recompute,
    judge_training_step,
    reference_path,
    two_rank_cells,
)

pytestmark = [pytest.mark.skipif(FACTS.gdn == "absent", reason=f"{FACTS.release} has no GatedDeltaNet"),
              pytest.mark.heavy]


@pytest.fixture(scope="module")
def matrix(megatron_cpu):
    """Every 2-rank cell's worst errors, from one spawn of two ranks."""
    from tests.support.megatron import free_port, spawn

    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "out.pt")
        two = [(c, r) for c in two_rank_cells() for r in (False, True)]
        spawn(_worker, (2, free_port(), reference_path(tmp, two_rank_cells()), out_path, two), 2)
        return torch.load(out_path)


@pytest.mark.parametrize("recompute", [False, True], ids=["recompute-none", "recompute-full"])
@pytest.mark.parametrize("cell", two_rank_cells(), ids=ids(two_rank_cells()))
def test_packed_training_step_matches_per_sequence_runs(matrix, cell, recompute):
    judge_training_step(matrix, cell, recompute)


@pytest.mark.parametrize("cell", two_rank_cells(), ids=ids(two_rank_cells()))
def test_full_recompute_is_bitwise_no_recompute(matrix, cell):
    judge_full_recompute(matrix, cell)
