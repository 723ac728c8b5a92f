"""Helpers for running megatron-core on a machine without a GPU (tests, the CPU demo).

Never imported by gdn_compat itself: ``init_megatron_cpu()`` changes torch and megatron globals
(design.md section 7) so that GatedDeltaNet and GPTModel can be built and trained on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import socket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init_world(backend: str, rank: int, world_size: int, context_parallel_size: int, port: int | None) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port or _free_port())
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, context_parallel_size=context_parallel_size)


def init_megatron_cpu(rank: int = 0, world_size: int = 1, context_parallel_size: int = 1, port: int | None = None) -> None:
    """A gloo world (1 rank by default), megatron's model-parallel state, CUDA-only helpers on the CPU."""
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    torch._dynamo.config.disable = True  # megatron's jit_fuser would compile per shape, slowly, on CPU
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        yield

    mrandom.CudaRNGStatesTracker.fork = fork
    mrandom._get_all_rng_states = lambda: {}
    mrandom._set_all_rng_states = lambda *a, **k: None
    _init_world("gloo", rank, world_size, context_parallel_size, port)


def init_megatron_cuda(rank: int = 0, world_size: int = 1, context_parallel_size: int = 1, port: int | None = None) -> None:
    """The same on GPUs (NCCL), one rank per GPU."""
    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.cuda.set_device(rank)
    _init_world("nccl", rank, world_size, context_parallel_size, port)
    model_parallel_cuda_manual_seed(1234)
