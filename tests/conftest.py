"""Shared fixtures: megatron-core on CPU (design.md section 7) and the release under test."""

from __future__ import annotations

import importlib.metadata as md

import pytest


def megatron_version() -> str | None:
    try:
        return md.version("megatron-core")
    except md.PackageNotFoundError:
        return None


MEGATRON = megatron_version()


@pytest.fixture(scope="session")
def megatron_cpu():
    """megatron-core ready on this machine: "cuda" on a GPU machine, else "cpu" (see gdn_compat.testing)."""
    if MEGATRON is None:
        pytest.skip("megatron-core is not installed")
    import torch

    from gdn_compat.testing import init_megatron_cpu, init_megatron_cuda

    if torch.cuda.is_available():
        init_megatron_cuda()
        yield "cuda"
    else:
        init_megatron_cpu()
        yield "cpu"
