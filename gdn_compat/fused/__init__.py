"""gdn_compat's fused GDN region in Triton: what lies between the input projection and the delta rule, and
between the delta rule and the output projection, in a few kernels of our own.

``conv.py`` (varlen causal conv + SiLU + l2norm + head repeat), ``gate.py`` (g and beta), ``norm.py`` (gated
RMSNorm), ``region.py`` (the autograd Function tying them to a delta-rule core), ``cores.py`` (fla's,
FlashQLA's and a torch core), ``reference.py`` (the same math in plain torch). Nothing here knows about
megatron; the patch ``gdn_fused`` decides when a layer's packed call runs through it. Importing this
package imports nothing; its modules need Triton (on CUDA, or its interpreter with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib.util

# Every kernel here, in every launch configuration its wrappers pick, compiles for sm80, sm90 and sm100 with each Triton
# that torch 2.7-2.15 ship (nox -s triton_compile, on a machine without a GPU); run on an H200 with Triton 3.6.0
TRITON_COMPILED = ("3.3.1", "3.4.0", "3.5.1", "3.6.0", "3.7.0", "3.7.1", "3.8.0", "3.9.0")


def triton_checked(version: str | None) -> str:
    """What is known of the installed Triton (its version) compiling these kernels."""
    if version is None:
        return "Triton is not installed"
    base = version.split("+")[0]
    if base in TRITON_COMPILED:
        return f"Triton {version}: every fused kernel compiles for sm80/sm90/sm100 (checked without a GPU)"
    return (f"Triton {version}: not checked (the kernels compile with Triton {TRITON_COMPILED[0]}-{TRITON_COMPILED[-1]}, "
            f"the ones torch 2.7-2.15 ship)")


def unavailable() -> str | None:
    """Why the fused kernels cannot run in this process (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def interpreted() -> bool:
    """Whether this process's Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when the
    kernel modules were imported): then they take CPU tensors."""
    from gdn_compat.fused import conv

    return type(conv._conv_fwd).__name__ == "InterpretedFunction"
