"""Fresh interpreters for the tests that need one (the README's snippets, the demo, a process without fla, the
GDN_COMPAT_AUTO hook), started together: each spends ~8 CPU seconds importing torch and megatron-core, and two at
once use both cores. Stdlib only."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from typing import TypeVar

K = TypeVar("K")


def run_together(runs: Mapping[K, tuple[list[str], Mapping[str, str] | None]], cwd=None,
                 timeout: float | None = None) -> dict[K, tuple[int, str, str]]:
    """Start every ``(argv, env)`` of ``runs`` at once (``env`` None: this process's), then wait for each in turn,
    reading both its pipes to the end. Returns ``{key: (returncode, stdout, stderr)}``."""
    procs = {k: subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, (argv, env) in runs.items()}
    out = {}
    for k, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=timeout)
        out[k] = (proc.returncode, stdout, stderr)
    return out
