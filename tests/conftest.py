"""Shared fixtures: megatron-core on CPU (design.md section 7) and the release under test."""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
import socket

import pytest



def megatron_version() -> str | None:
    try:
        return md.version("megatron-core")
    except md.PackageNotFoundError:
        return None


MEGATRON = megatron_version()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def megatron_cpu():
    """A 1-rank gloo world with megatron's model-parallel state, CUDA helpers pointed at the CPU."""
    if MEGATRON is None:
        pytest.skip("megatron-core is not installed")
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(_free_port())
            dist.init_process_group("nccl", rank=0, world_size=1)
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
        yield "cuda"
        return
    # torch.compile of megatron's jit_fuser'd helpers costs ~15 s per shape on CPU and changes
    # nothing tested here; on GPU it stays on (part of the bitwise comparison with upstream).
    torch._dynamo.config.disable = True
    torch.cuda.current_device = lambda: "cpu"  # the GDN constructor asks for it
    from megatron.core.tensor_parallel import random as mrandom

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        yield

    mrandom.CudaRNGStatesTracker.fork = fork
    mrandom._get_all_rng_states = lambda: {}
    mrandom._set_all_rng_states = lambda *a, **k: None
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield "cpu"
