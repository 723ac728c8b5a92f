"""The acceptance cells of tests/test_acceptance.py that take four gloo ranks: tp = 2 x cp = 2, with sequence
parallelism, through the head all-to-all and (gdn_cp_state) passing the state with value heads per tensor-parallel rank
that do not divide cp. The same model, reference and bars; one release per GDN generation (0.17.1, 0.19.2), as the
other multi-rank suites added under #55's budget."""

from __future__ import annotations

import pytest

from tests.support.release import FACTS, MEGATRON
from tests.test_acceptance import (
    four_rank_cells,
    ids,
    judge_full_recompute,
    judge_training_step,
    spawned,
)

pytestmark = [pytest.mark.skipif(FACTS.gdn == "absent", reason=f"{FACTS.release} has no GatedDeltaNet"),
              pytest.mark.skipif(not four_rank_cells(), reason=f"the tp x cp = 4 cells run on one release per GDN "
                                                               f"generation (0.17.1, 0.19.2), not {MEGATRON}"),
              pytest.mark.heavy]


@pytest.fixture(scope="module")
def matrix(megatron_cpu):
    """Every 4-rank cell's worst errors, from one spawn of four ranks."""
    return spawned(four_rank_cells(), 4)


@pytest.mark.parametrize("recompute", [False, True], ids=["recompute-none", "recompute-full"])
@pytest.mark.parametrize("cell", four_rank_cells(), ids=ids(four_rank_cells()))
def test_packed_training_step_matches_per_sequence_runs(matrix, cell, recompute):
    judge_training_step(matrix, cell, recompute)


@pytest.mark.parametrize("cell", four_rank_cells(), ids=ids(four_rank_cells()))
def test_full_recompute_is_bitwise_no_recompute(matrix, cell):
    judge_full_recompute(matrix, cell)
