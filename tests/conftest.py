"""Shared fixtures: megatron-core on this machine (CPU stand-ins and gloo, or a GPU), undone at the end."""

from __future__ import annotations

import pytest

from tests.support.release import MEGATRON


@pytest.fixture(scope="session")
def megatron_cpu():
    """megatron-core ready on this machine: "cuda" on a GPU machine, else "cpu" (see tests.support.megatron)."""
    if MEGATRON is None:
        pytest.skip("megatron-core is not installed")
    import torch

    from tests.support.megatron import world

    with world(cuda=torch.cuda.is_available()) as device:
        yield device
