"""gdn_fused (opt-in): the GDN region around the delta rule in gdn_compat's own Triton kernels, on every release.

Between the input projection and the delta rule a packed GDN call runs, in the release, a varlen conv, SiLU,
a split, the q/k l2norm, the q/k head repeat, the gate and beta, and copies; after it, the gated RMSNorm and
a concatenation of the input projection's gradients: about 2.4 ms on an H200 at 16k tokens against a
traffic floor of ~0.4 ms. With this switch on, every packed (``qkv_format='thd'``) call without an
inference context runs that region through ``gdn_compat.fused``: one kernel pass from the input
projection's output to q, k, v (conv + bias + SiLU + l2norm, repeated only for a core that needs it), one
for g (fp32, the exp of A_log included) and beta, the delta-rule core (FlashQLA's when gdn_flashqla applies,
else fla's), and one for RMSNorm(o) x SiLU(z); backward recomputes q, k, v from the saved input instead of
storing them, sums every weight gradient without atomics (bitwise run to run, also in ``deterministic_mode``)
and writes the input projection's gradient in place. Sizes come from shapes only: a CUDA-graph capture with
a ``PackBuffer`` replays any layout (with fla's core, or FlashQLA 0.1.3's). Tensor, sequence and context parallelism, full
recompute and MTP see the same layer.

A call keeps the unfused path, with the reason logged once, where the fused kernels do not apply: no Triton,
no CUDA (unless Triton's interpreter is on), a non-SiLU activation, head dims that are not powers of 2 up to
256, a conv wider than 8, an out_norm that is not an RMSNorm, or no deterministic core in
``deterministic_mode``. Unpacked calls and inference stay the release's own code. Off by default:
``apply(gdn_fused=True)`` or ``GDN_COMPAT_ENABLE=gdn_fused``.
"""

from __future__ import annotations

from typing import Any

from gdn_compat._probe import GDN_MODULE, Facts
from gdn_compat._registry import Patch, Target
from gdn_compat.patches.gdn_thd import carrier_skip, needs_gdn_thd, route
from gdn_compat.patches.gdn_thd.fast import Fast


def decide(facts: Facts) -> str | None:
    skip = carrier_skip(facts)
    if skip:
        return skip
    if facts.triton is None:
        return f"not patched on {facts.release}: Triton is not installed (the fused kernels are Triton kernels)"
    return None


def build(facts: Facts, original: Any) -> Any:
    return route(facts, original, lambda layer: True, Fast(fused=True))


PATCH = Patch(
    name="gdn_fused",
    target=Target(GDN_MODULE, "GatedDeltaNet", "forward"),
    decide=decide,
    build=build,
    summary="packed GDN calls run conv + SiLU + l2norm, the gate and the gated norm in gdn_compat's Triton kernels "
            "(one autograd region around the delta-rule core, no atomics) where they apply, else the unfused path "
            "with the reason logged; unpacked calls and inference are the release's",
    requires=needs_gdn_thd,
    opt_in=True,
)
