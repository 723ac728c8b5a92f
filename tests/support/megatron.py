"""megatron-core on a machine without a GPU (design: gloo, CPU stand-ins for CUDA-only helpers).

Everything here changes torch and megatron globals, so it is undoable: ``cpu_stand_ins()`` is a
context manager (the session fixture ``megatron_cpu`` enters it and leaves it at the end), and
``world()`` tears the process groups down on exit. Benchmarks and examples import this module too
(run them from the repository root with ``python -m benchmarks.NAME``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator

from tests.support.interpreter import once_per_launch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago: the key ``world()`` names a group's store by (one spawn's
    ranks get the same one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _NoStream:
    def wait_event(self, event) -> None:
        pass


@contextlib.contextmanager
def cpu_stand_ins() -> Iterator[None]:
    """CPU stand-ins for the CUDA-only pieces a GatedDeltaNet / GPTModel touches, undone on exit."""
    import pytest
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        yield

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch._dynamo.config, "disable", True)  # jit_fuser would compile per shape, slowly
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        # 0.19's DDP asks for the current stream before every grad sync (to wait on CUDA-graph events)
        mp.setattr(torch.cuda, "current_stream", lambda *a, **k: _NoStream())
        mp.setattr(mrandom.CudaRNGStatesTracker, "fork", fork)
        mp.setattr(mrandom, "_get_all_rng_states", lambda: {})
        mp.setattr(mrandom, "_set_all_rng_states", lambda *a, **k: None)
        _inference_linears_without_te(mp)
        yield


def _inference_linears_without_te(mp) -> None:
    """megatron main (0.20) tests ``isinstance(m, (InferenceColumnParallelLinear, ...))`` while building an MTP
    layer; without Transformer Engine those names are MagicMock placeholders and isinstance raises. No linear is
    one of them then: say so where the function is looked up."""
    import importlib
    import sys

    try:
        layers = importlib.import_module("megatron.core.tensor_parallel.inference_layers")
    except ImportError:
        return
    if isinstance(getattr(layers, "InferenceColumnParallelLinear", type), type):
        return
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and hasattr(module, "is_inference_column_parallel_linear"):
            mp.setattr(module, "is_inference_column_parallel_linear", lambda module: False)


def moe_without_te() -> None:
    """0.15.x/0.16.x test ``te_general_gemm is not None`` without defining it when Transformer Engine
    is absent (NameError in every MoE router); define it as "not installed"."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@contextlib.contextmanager
def world(rank: int = 0, size: int = 1, *, tp: int = 1, cp: int = 1, port: int | None = None,
          cuda: bool = False, backend: str | None = None) -> Iterator[str]:
    """A process group (gloo on the CPU with the stand-ins, NCCL with ``cuda``; ``backend='gloo'`` with ``cuda``
    lets several ranks share one GPU, rank r on GPU r % count) and megatron's model-parallel state; yields the
    device name. Destroyed on exit."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.support import suite_records

    with contextlib.ExitStack() as stack:
        stack.callback(suite_records.log_imports)  # every rank's imports count for the heavy-suite records
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            stack.enter_context(cpu_stand_ins())
            stack.enter_context(once_per_launch())  # Triton's interpreter, where the ranks run gdn_compat's kernels
        if not dist.is_initialized():
            backend = backend or ("nccl" if cuda else "gloo")
            if size == 1:  # no TCP port to race for with other processes on the machine
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            else:  # nor with several: a file store, named by the ranks' common parent (spawn's forkserver) and port
                if port is None:
                    raise ValueError("world(): ranks of a group of more than one need the same port (free_port())")
                path = os.path.join(tempfile.gettempdir(), f"gdn-compat-store-{os.getppid()}-{port}")
                store = dist.FileStore(path, size)
                dist.init_process_group(backend, store=store, rank=rank, world_size=size)
                stack.callback(_check_out, store, path, size)  # after the group is gone
            stack.callback(dist.destroy_process_group)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
            stack.callback(parallel_state.destroy_model_parallel)
        if cuda:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
        yield "cuda" if cuda else "cpu"


def _check_out(store, path: str, size: int) -> None:
    """The last rank of a group to leave deletes its store's file (rank processes end in ``os._exit``: the store's
    own clean-up, in its destructor, never runs)."""
    if store.add("gdn_compat_left", 1) == size:
        os.remove(path)


_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "gdn_compat",
            "tests.support.megatron", "tests.support.gdn", "tests.support.model"]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn`` for the CPU rank tests, through a forkserver that imported torch and
    megatron-core once: every rank forks from it instead of importing them again (the forkserver runs no
    torch op, so forking it is safe). Same semantics as spawn: fresh globals, no state from the caller."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
