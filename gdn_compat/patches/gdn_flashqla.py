"""gdn_flashqla (opt-in): the delta rule of packed GDN calls through FlashQLA, on every release with GDN.

FlashQLA (``flash-qla``, the Qwen team's TileLang kernels) computes the same gated delta rule as fla's
``chunk_gated_delta_rule``, forward and backward, about 2-2.5x faster on an H200, and takes q/k with the
layer's key heads (grouped value heads), so the q/k repeat disappears too. With this switch on, every packed
(``qkv_format='thd'``) call without an inference context runs gdn_compat's packed path (``gdn_thd``) with the
delta rule through FlashQLA; the conv, l2norm, gate, norm and projections stay the release's kernels (or
gdn_fused's, when that switch is on too). Unpacked calls and inference stay the release's own code.

A call keeps fla's kernels, with the reason logged once, when FlashQLA does not apply: no CUDA, a GPU other
than sm90/sm100/sm103, head dims other than 128, activations not bf16/fp16, ``flash_qla`` failing to import,
or ``deterministic_mode`` with a FlashQLA whose source holds atomics (0.1.3 holds none: its kernels are
bitwise run to run, README). Context parallelism: after gdn_compat's all-to-all each rank holds whole
sequences of its heads, which FlashQLA runs as any pack; FlashQLA's own intra-card CP (``auto_cp``) stays
off. CUDA-graph capture, or offsets from a ``gdn_compat.graphs.PackBuffer``: FlashQLA takes a pack's chunk
metadata attached to its offsets tensor (flash-qla 0.1.3's ``flash_qla.utils.index``; the probe reads that file),
so gdn_compat hands it metadata built by device ops with sizes from shapes only, and one capture replays any
layout; where the installed FlashQLA does not read that attribute, such a call is refused with an error (it
would read a chunk count on the host). Needs flash-qla >= 0.1.3 (earlier releases
have a wrong dg for strong decay and an SM90 backward tail-padding bug). Off by default:
``apply(gdn_flashqla=True)`` or ``GDN_COMPAT_ENABLE=gdn_flashqla``.
"""

from __future__ import annotations

from typing import Any

from packaging.version import InvalidVersion, Version

from gdn_compat._probe import GDN_MODULE, Accepts, Facts
from gdn_compat._registry import Patch, Target
from gdn_compat.patches.gdn_thd import carrier_skip, needs_gdn_thd, route
from gdn_compat.patches.gdn_thd.fast import Fast

MINIMUM = Version("0.1.3")


def flashqla_skip(facts: Facts) -> str | None:
    """Why the installed FlashQLA cannot be used (None: it can, subject to the per-call checks)."""
    if facts.flashqla is None:
        return ("flash-qla is not installed (pip install 'flash-qla>=0.1.3'; it needs tilelang, which compiles "
                "its kernels with nvcc on first use)")
    try:
        old = Version(facts.flashqla.version) < MINIMUM
    except InvalidVersion:
        return f"flash-qla version {facts.flashqla.version!r} cannot be read"
    if old:
        return (f"flash-qla {facts.flashqla.version} is older than 0.1.3, which fixed its dg for strong decay and its "
                f"SM90 backward tail padding; pip install 'flash-qla>=0.1.3'")
    return None


def decide(facts: Facts) -> str | None:
    skip = carrier_skip(facts)
    if skip:
        return skip
    why = flashqla_skip(facts)
    return f"{facts.release}: {why}" if why else None


def build(facts: Facts, original: Any) -> Any:
    paths = Fast(flashqla=True, flashqla_deterministic=facts.flashqla_atomic_free is Accepts.YES,
                 flashqla_graphs=facts.flashqla_metadata is Accepts.YES)
    return route(facts, original, lambda layer: True, paths)


PATCH = Patch(
    name="gdn_flashqla",
    target=Target(GDN_MODULE, "GatedDeltaNet", "forward"),
    decide=decide,
    build=build,
    summary="packed GDN calls run the delta rule through FlashQLA (q/k not repeated) where it applies (CUDA sm90/"
            "sm100/sm103, head dims 128, bf16/fp16), else fla's kernels with the reason logged; unpacked calls "
            "and inference are the release's",
    requires=needs_gdn_thd,
    opt_in=True,
)
