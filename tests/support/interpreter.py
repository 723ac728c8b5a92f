"""Triton's interpreter without its repeated set-up (#55): ``triton.language`` patched once per kernel launch.

With ``TRITON_INTERPRET=1`` Triton runs a kernel by calling its Python function once per program, with
``triton.language``'s builtins replaced by numpy versions for the launch (``interpreter._patch_lang``, undone when the
launch ends). Triton 3.7-3.9 also call ``_patch_lang`` on every call of a ``@triton.jit`` helper inside the kernel
(``InterpretedFunction.__call__``), per program and per loop step, although the launch has already replaced the same
modules; each call walks every member of ``tl``, ``tl.tensor`` and ``tl.math`` with ``inspect.getmembers``. In a
profile of a fused acceptance cell that was ~15% of the cell's time (``_patch_builtin`` 23.5 of 160 s).

``once_per_launch()`` makes a helper's ``_patch_lang`` a no-op while a launch that already patched the same language
modules runs. A helper's own patching re-installs what the launch installed (builtins already replaced are not
builtins any more and are skipped; the rest are equal closures) and its scope is never restored, so skipping it
changes nothing the kernel computes (``tests/test_interpreter_support.py`` checks a kernel's bits with and without).
Installed only on a Triton whose interpreter has that shape (3.7-3.9); elsewhere a no-op that says why.
"""

from __future__ import annotations

import contextlib
import os
import threading

_LAUNCH = threading.local()  # .langs: the language modules this thread's running launch patched (None: no launch)


def why_not() -> str | None:
    """Why ``once_per_launch`` would change nothing here (None: it applies)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET is not 1: kernels are compiled, not interpreted"
    try:
        from triton.runtime import interpreter
    except ImportError as exc:
        return f"no Triton interpreter: {exc}"
    for name in ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction"):
        if not hasattr(interpreter, name):
            return f"this Triton's interpreter has no {name} (an older shape: 3.7-3.9 have one)"
    return None


def _langs(fn) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


@contextlib.contextmanager
def once_per_launch():
    """While inside: a ``@triton.jit`` helper's call skips re-patching what its launch patched. Undone on exit."""
    if why_not() is not None:
        yield
        return
    from triton.runtime import interpreter

    patch_lang, run = interpreter._patch_lang, interpreter.GridExecutor.__call__
    if getattr(patch_lang, "once_per_launch", False):  # an outer once_per_launch() holds it
        yield
        return

    def _patch_lang(fn):
        done = getattr(_LAUNCH, "langs", None)
        if done is not None and _langs(fn) <= done:
            return interpreter._LangPatchScope()  # nothing set, nothing to restore
        scope = patch_lang(fn)
        if done is not None:
            _LAUNCH.langs = done | _langs(fn)
        return scope

    _patch_lang.once_per_launch, _patch_lang.original = True, patch_lang  # type: ignore[attr-defined]

    def __call__(self, *args, **kwargs):
        outer = getattr(_LAUNCH, "langs", None)
        _LAUNCH.langs = frozenset()  # the launch's own _patch_lang patches for real
        try:
            return run(self, *args, **kwargs)
        finally:
            _LAUNCH.langs = outer

    __call__.original = run  # type: ignore[attr-defined]
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = _patch_lang, __call__
    try:
        yield
    finally:
        interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, run
