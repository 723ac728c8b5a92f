"""Compile every gdn_compat Triton kernel, in every launch configuration the code picks, for sm80 / sm90 / sm100 with the
installed Triton, on a machine without a GPU: ``python -m tests.support.triton_compile [--json FILE]`` (``nox -s
triton_compile`` runs it once per Triton that torch 2.7-2.15 ship).

The launch configurations are the wrappers' own: each wrapper of ``gdn_compat.fused`` (conv, gate, norm) is called on
``meta`` tensors of the shapes a layer hands it (head dims 16-256, dtypes bf16 / fp16 / fp32, conv widths 2-8, with
and without conv bias and l2norm, head counts 1-64), with its kernels' launches captured instead of run; every
distinct (kernel, argument types, constexprs, warps) is then compiled by ``triton.compile`` for an explicit
``GPUTarget``: Triton's front end, its passes and ptxas, no driver. torch is only the wrappers' (shapes, dtypes);
the compiler is the installed Triton. Prints one line per target and a verdict; exit 1 when anything failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import inspect
import json
import multiprocessing
import os
import sys
import tempfile
import time
from typing import Any

# a cache of its own: a kernel compiled before (by a test, another run) must be compiled again here
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gdn-compat-triton-compile-")
import torch  # noqa: E402
import triton  # noqa: E402

TARGETS = {"sm80": 80, "sm90": 90, "sm100": 100}
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.int64: "i64"}


def launches() -> list[tuple[Any, tuple, dict]]:
    """(kernel, positional args, keyword args) of every launch the wrappers make over the shapes layers have."""
    from gdn_compat.fused import conv, gate, norm

    seen: list[tuple[Any, tuple, dict]] = []
    kernels = {(conv, "_conv_fwd"), (conv, "_conv_bwd"), (gate, "_gate_fwd"), (gate, "_gate_bwd"),
               (norm, "_norm_fwd"), (norm, "_norm_bwd")}
    originals = {(m, n): getattr(m, n) for m, n in kernels}

    class Capture:
        def __init__(self, kernel: Any):
            self.kernel = kernel

        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kwargs: seen.append((self.kernel, args, kwargs))

    for (module, name), kernel in originals.items():
        setattr(module, name, Capture(kernel))
    try:
        meta = dict(device="meta")
        T = 300
        for d, dtype, width, bias, l2 in _conv_cases():
            heads, rep = 2, 2
            cols = 2 * heads * d * 2 + 2 * heads * rep * d + 2 * heads * rep
            x = torch.empty(T, cols, dtype=dtype, **meta)
            w = torch.empty(4 * heads * d, width, dtype=dtype, **meta)
            b = torch.empty(4 * heads * d, dtype=dtype, **meta) if bias else None
            starts = torch.empty(T, dtype=torch.int32, **meta)
            out = torch.empty(T, heads * rep, d, dtype=dtype, **meta)
            conv.conv_fwd(x, w, b, starts, out, 0, heads, d, rep, l2, 1e-6)
            dw_part = torch.empty(conv.partials(T), w.shape[0], width, dtype=torch.float32, **meta)
            db_part = torch.empty(conv.partials(T), w.shape[0], dtype=torch.float32, **meta)
            conv.conv_bwd(x, w, b, starts, starts, out, torch.empty_like(x), dw_part, db_part, 0, heads, d, rep, l2, 1e-6)
        for hv, dtype in [(h, torch.bfloat16) for h in (4, 16, 32, 48, 64)] + [(32, torch.float16), (32, torch.float32)]:
            x = torch.empty(T, 4 * hv, dtype=dtype, **meta)
            a_log = torch.empty(hv, dtype=torch.float32, **meta)
            g, beta = gate.gate_fwd(x, a_log, a_log, 2 * hv, hv, hv)
            gate.gate_bwd(x, a_log, a_log, g, beta, torch.empty_like(x), 2 * hv, hv, hv)
        for d, dtype, zc in [(d, torch.bfloat16, 0.0) for d in (32, 64, 128, 256)] + [
                (128, torch.bfloat16, 1.0), (128, torch.float16, 0.0), (128, torch.float32, 0.0)]:
            heads = 4
            o = torch.empty(T, heads, d, dtype=dtype, **meta)
            x = torch.empty(T, 2 * heads * d, dtype=dtype, **meta)
            w = torch.empty(d, dtype=torch.float32, **meta)
            dy = norm.norm_fwd(o, x, w, heads * d, 1e-5, zc)
            norm.norm_bwd(dy, o, x, w, heads * d, 1e-5, zc)
            norm.norm_bwd(dy, o, x, w, heads * d, 1e-5, zc, dz=torch.empty_like(dy))
            norm.norm_dz(dy, o, x, w, torch.empty_like(dy), heads * d, 1e-5, zc)
    finally:
        for (module, name), kernel in originals.items():
            setattr(module, name, kernel)
    return seen


def _conv_cases():
    for d in (32, 64, 128, 256):
        for l2 in (True, False):
            yield d, torch.bfloat16, 4, False, l2
    for dtype in (torch.float16, torch.float32):
        yield 128, dtype, 4, False, True
    for width in (2, 3, 8):
        yield 128, torch.bfloat16, width, True, True


def _unwrap(kernel: Any) -> Any:
    while not hasattr(kernel, "arg_names") and hasattr(kernel, "fn"):  # an Autotuner / Heuristics
        kernel = kernel.fn
    return kernel


def specs(found: list[tuple[Any, tuple, dict]]) -> list[dict[str, Any]]:
    """Distinct compile jobs: kernel, signature (name -> type), constexprs (name -> value), warps."""
    jobs: dict[str, dict[str, Any]] = {}
    for kernel, args, kwargs in found:
        fn = _unwrap(kernel)
        names = list(fn.arg_names)
        constexprs = {n: kwargs[n] for n in names if n in kwargs}
        signature = {}
        for name, value in zip(names, args):
            if isinstance(value, torch.Tensor):
                signature[name] = "*" + TYPES[value.dtype]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            else:
                signature[name] = "fp32"
        for name in constexprs:
            signature[name] = "constexpr"
        warps = kwargs.get("num_warps", 4)
        key = json.dumps([fn.__name__, signature, {k: str(v) for k, v in constexprs.items()}, warps], sort_keys=True)
        jobs.setdefault(key, dict(fn=fn, name=fn.__name__, signature=signature, constexprs=constexprs, warps=warps))
    return list(jobs.values())


def compile_one(job: dict[str, Any], capability: int) -> str | None:
    """None when the job compiles to a cubin for ``capability``, else the error."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = inspect.signature(ASTSource.__init__).parameters
    ordered = {n: job["signature"][n] for n in job["fn"].arg_names}
    if "constexprs" in params:
        src = ASTSource(job["fn"], ordered, constexprs={(job["fn"].arg_names.index(n),): v
                                                        for n, v in job["constexprs"].items()})
    else:  # Triton <= 3.2 spelled it constants
        src = ASTSource(job["fn"], ordered, constants={n: v for n, v in job["constexprs"].items()})
    try:
        out = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": job["warps"]})
        return None if out.asm.get("cubin") else "no cubin produced"
    except Exception as exc:  # noqa: BLE001 - every failure is a finding
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


JOBS: list[dict[str, Any]] = []


def _compile_index(item: tuple[int, int]) -> str | None:
    return compile_one(JOBS[item[0]], item[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.triton_compile")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--targets", default=",".join(TARGETS))
    args = parser.parse_args(argv)
    version = md.version("triton")
    JOBS[:] = specs(launches())
    jobs = JOBS
    results: dict[str, Any] = {"triton": version, "torch": torch.__version__, "jobs": len(jobs), "targets": {}}
    failed = 0
    # forked workers inherit JOBS (Triton's JITFunctions do not pickle); one per core
    pool = multiprocessing.get_context("fork").Pool(max(1, min(4, os.cpu_count() or 1)))
    for target in args.targets.split(","):
        started = time.perf_counter()
        outcomes = pool.map(_compile_index, [(i, TARGETS[target]) for i in range(len(jobs))])
        errors = {f"{job['name']} {job['constexprs']} warps={job['warps']}": why
                  for job, why in zip(jobs, outcomes) if why}
        failed += len(errors)
        results["targets"][target] = {"failed": errors, "seconds": round(time.perf_counter() - started, 1)}
        print(f"triton {version} {target}: {len(jobs) - len(errors)}/{len(jobs)} kernel configurations compile "
              f"({results['targets'][target]['seconds']} s)", flush=True)
        for what, why in list(errors.items())[:5]:
            print(f"  {what}: {why}", flush=True)
    pool.close()
    pool.join()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(f"verdict: {'every kernel compiles' if not failed else f'{failed} failed'} with Triton {version}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
