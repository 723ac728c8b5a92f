"""The acceptance cells of tests/test_acceptance.py that take two gloo ranks (tp = 2 with and without sequence
parallelism, with MTP and MoE; cp = 2; their gdn_fused cells): the same model, reference and bars, in a file of
their own so that pytest-xdist runs them beside the 1-rank cells."""

from __future__ import annotations

import pytest

from tests.support.release import FACTS
from tests.test_acceptance import (
    ids,
    judge_full_recompute,
    judge_training_step,
    spawned,
    two_rank_cells,
)

pytestmark = [pytest.mark.skipif(FACTS.gdn == "absent", reason=f"{FACTS.release} has no GatedDeltaNet"),
              pytest.mark.heavy]


@pytest.fixture(scope="module")
def matrix(megatron_cpu):
    """Every 2-rank cell's worst errors, from one spawn of two ranks."""
    return spawned(two_rank_cells(), 2)


@pytest.mark.parametrize("recompute", [False, True], ids=["recompute-none", "recompute-full"])
@pytest.mark.parametrize("cell", two_rank_cells(), ids=ids(two_rank_cells()))
def test_packed_training_step_matches_per_sequence_runs(matrix, cell, recompute):
    judge_training_step(matrix, cell, recompute)


@pytest.mark.parametrize("cell", two_rank_cells(), ids=ids(two_rank_cells()))
def test_full_recompute_is_bitwise_no_recompute(matrix, cell):
    judge_full_recompute(matrix, cell)
