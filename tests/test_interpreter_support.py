"""tests/support/interpreter.py: Triton's interpreter patching ``triton.language`` once per launch instead of on every
call of a ``@triton.jit`` helper changes no bit a kernel computes, and leaves the language as it found it."""

from __future__ import annotations

import pytest
import torch

from tests.support.fused import CU, inputs, token_bounds
from tests.support.interpreter import why_not

pytestmark = [pytest.mark.skipif(why_not() is not None, reason=str(why_not())), pytest.mark.interpreted_kernels]


def test_a_kernel_whose_helpers_skip_repatching_gives_the_same_bits_and_leaves_the_language_restored(monkeypatch):
    import triton.language as tl
    from triton.runtime import interpreter

    from gdn_compat.fused import conv

    assert getattr(interpreter._patch_lang, "once_per_launch", False), "tests/conftest.py installs it for the session"
    patched = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *rest: (patched.append(pkg), real(pkg, *rest))[1])
    x, w, b = inputs(channels=48, width=4, bias=True)
    starts, ends = token_bounds(CU, x.shape[0])
    dout = torch.randn(x.shape[0], 6, 16)

    def fwd_bwd() -> list[torch.Tensor]:  # two launches; the backward's kernel calls helpers in its loops
        out = torch.empty(x.shape[0], 6, 16)
        conv.conv_fwd(x, w, b, starts, out, 0, 3, 16, 2, True, 1e-6)
        dx, parts = torch.full_like(x, float("nan")), conv.partials(x.shape[0])
        dw, db = torch.empty(parts, *w.shape), torch.empty(parts, w.shape[0])
        conv.conv_bwd(x, w, b, starts, ends, dout, dx, dw, db, 0, 3, 16, 2, True, 1e-6)
        return [out, dx, dw, db]

    once = fwd_bwd()
    per_launch = len(patched) / 2
    patched.clear()
    with monkeypatch.context() as m:  # Triton's own: every helper call patches the language again
        m.setattr(interpreter, "_patch_lang", interpreter._patch_lang.original)
        m.setattr(interpreter.GridExecutor, "__call__", interpreter.GridExecutor.__call__.original)
        every_call = fwd_bwd()
    assert all(torch.equal(a, b) for a, b in zip(once, every_call, strict=True))
    assert len(patched) > 10 * per_launch * 2, (len(patched), per_launch)  # the backward's helpers did patch
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__add__)  # restored after each launch
