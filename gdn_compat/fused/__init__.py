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
