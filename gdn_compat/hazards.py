"""Known-bad GDN kernel stacks, as a pure function of the probe record.

Each rule reads ``Facts`` (and, where the model is known, its smallest key head dim) and returns
findings; nothing here touches the GPU. Severities: ``error`` (will crash), ``danger`` (may compute
wrong results), ``warning`` (gdn_compat cannot help with this stack), ``info``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from packaging.version import InvalidVersion, Version

from gdn_compat._probe import Accepts, Conv, Facts, Layout, Mtp, Thd

Severity = Literal["error", "danger", "warning", "info"]
FLA_640 = "https://github.com/fla-org/flash-linear-attention/issues/640"
BAD_TRITON = (Version("3.4.0"), Version("3.7.1"))  # [low, high): miscompiles chunk_bwd_dqkwg on sm_90


@dataclasses.dataclass(frozen=True)
class Finding:
    severity: Severity
    code: str
    message: str
    source: str = ""
    fix: str = ""

    def __str__(self) -> str:
        text = f"[{self.severity}] {self.code}: {self.message}"
        if self.fix:
            text += f" Fix: {self.fix}"
        if self.source:
            text += f" ({self.source})"
        return text


def _version(text: str | None) -> Version | None:
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def _has_gdn(facts: Facts) -> bool:
    return facts.gdn in (Layout.MODULE, Layout.PACKAGE)


def check(facts: Facts, key_head_dim: int | None = None) -> list[Finding]:
    """All findings for this stack; ``key_head_dim`` is the model's (smallest) GDN key head dim if known."""
    return [*_fla_install(facts), *_fla_640(facts, key_head_dim), *_gdn_shapes(facts)]


def _fla_install(facts: Facts) -> list[Finding]:
    if facts.fla_error:
        return [Finding(
            "error", "fla-import",
            f"{facts.fla or 'fla'} fails to import with Triton {facts.triton}: {facts.fla_error}. "
            f"megatron-core then cannot import its GatedDeltaNet at all.",
            fix="install the fla-core release made for this Triton (fla-core 0.4.x needs Triton < 3.7; "
                "newer Triton needs fla-core >= 0.5)")]
    if facts.fla is None and _has_gdn(facts):
        return [Finding(
            "error", "fla-missing",
            f"{facts.release} has GatedDeltaNet but fla is not installed: building a GDN "
            f"layer raises ImportError deep inside model construction.",
            fix="pip install fla-core (kernels only; flash-linear-attention also pulls transformers)")]
    if _has_gdn(facts) and Accepts.NO in (facts.fla_varlen.rule, facts.fla_varlen.conv):
        return [Finding(
            "error", "fla-no-varlen",
            f"{facts.fla}: chunk_gated_delta_rule cu_seqlens={facts.fla_varlen.rule}, causal_conv1d "
            f"cu_seqlens={facts.fla_varlen.conv}; packed (THD) GDN cannot run on GPU.",
            fix="pip install 'fla-core>=0.4.2'")]
    return []


def _fla_640(facts: Facts, key_head_dim: int | None) -> list[Finding]:
    fla_v, triton_v = _version(facts.fla.version if facts.fla else None), _version(facts.triton)
    bad_triton = triton_v is not None and BAD_TRITON[0] <= Version(triton_v.base_version) < BAD_TRITON[1]
    if fla_v is None or facts.fla_error or not bad_triton:
        return []
    hopper = facts.gpu is not None and facts.gpu.capability[0] == 9
    if facts.gpu is None and facts.notes.get("gpu", "").startswith("not inspected"):
        return [Finding(
            "info", "fla-640-unchecked",
            f"Triton {facts.triton} is in the range that miscompiles fla's gated backward on Hopper "
            f"(sm_90); the GPU was {facts.notes['gpu']}.",
            FLA_640, "run `python -m gdn_compat` on the GPU node")]
    if hopper and fla_v >= Version("0.5.0") and not facts.tilelang:
        return [Finding(
            "error", "fla-640-crash",
            f"{facts.gpu} with Triton {facts.triton} and {facts.fla}: fla refuses its miscompiled gated "
            f"chunk_bwd_dqkwg kernel, so the first GDN backward raises RuntimeError.",
            FLA_640, "upgrade Triton to >= 3.7.1, or pip install tilelang, or use fla-core 0.4.2 "
                     "with key head dims of 128")]
    if hopper and fla_v < Version("0.5.0"):
        affected = key_head_dim is None or 33 <= key_head_dim <= 64
        dim = "key head dim unknown" if key_head_dim is None else f"key head dim {key_head_dim}"
        return [Finding(
            "danger" if affected else "info", "fla-640-miscompile",
            f"{facts.gpu} with Triton {facts.triton} and {facts.fla} ({dim}): the gated chunk_bwd_dqkwg "
            f"kernel is miscompiled for 64-wide key tiles (key head dims 33-64) and then gives wrong "
            f"gradients silently; 128-dim key heads tile to 128 and are not affected."
            + ("" if affected else " This model is not affected."),
            FLA_640, "upgrade Triton to >= 3.7.1 (then fla-core >= 0.5), or keep key head dims at 128")]
    return []


def _gdn_shapes(facts: Facts) -> list[Finding]:
    out = []
    if facts.gdn_legacy_shape:
        out.append(Finding(
            "info", "gdn-conv-path",
            f"{facts.release} runs unpacked GDN convolutions through {facts.gdn_conv}"
            + (" (slower than the causal_conv1d package)" if facts.gdn_conv is Conv.NN_CONV1D else "")
            + "; packed (THD) input through gdn_compat uses fla's varlen causal_conv1d."))
    for what, field, unknown in (("GatedDeltaNet", "gdn_thd", facts.gdn_thd is Thd.UNKNOWN),
                                 ("MultiTokenPredictionLayer", "mtp", facts.mtp is Mtp.UNKNOWN)):
        if unknown:
            out.append(Finding(
                "warning", "unknown-shape",
                f"gdn_compat does not recognise this megatron-core's {what} ({facts.notes.get(field, 'unknown')}); "
                f"it patches nothing there."))
    return out


def failing(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity in ("error", "danger")]
