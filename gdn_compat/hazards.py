"""Known-bad GDN kernel stacks, as a pure function of the probe record.

Each rule reads ``Facts`` (and, where the model is known, its smallest key head dim) and returns
findings; nothing here touches the GPU. Severities: ``error`` (will crash), ``danger`` (may compute
wrong results), ``warning`` (gdn_compat cannot help with this stack), ``info``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from packaging.version import InvalidVersion, Version

from gdn_compat._probe import FLA_FIX, Accepts, Conv, Facts, Layout, Mtp, Roll, Thd

Severity = Literal["error", "danger", "warning", "info"]
FLA_640 = "https://github.com/fla-org/flash-linear-attention/issues/640"
BAD_TRITON = (Version("3.4.0"), Version("3.7.1"))  # [low, high): miscompiles chunk_bwd_dqkwg on sm_90
FLA = "https://github.com/fla-org/flash-linear-attention"
# Blackwell (sm_100 B200, sm_103 B300): what the threads establish (read 2026-12-01)
BLACKWELL_COMPILE = (Version("3.4.0"), Version("3.6.0"))  # fla #607, #612, #638: backward fails to compile
VERIFIED_SM = 9  # gdn_compat's GPU suite runs on an H200 (sm_90)


@dataclasses.dataclass(frozen=True)
class Finding:
    severity: Severity
    code: str
    message: str
    source: str = ""
    fix: str = ""
    fixed_by: str = ""  # a gdn_compat patch that takes this hazard away where it applies (nothing to do then)

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
    return [*_fla_install(facts), *_fla_640(facts, key_head_dim), *_gpu_generation(facts), *_gdn_shapes(facts),
            *_flashqla(facts), *_zero_length(facts)]


def _zero_length(facts: Facts) -> list[Finding]:
    """0.18/0.19's native THD forward hands fla only cu_seqlens; an fla whose prepare_chunk_indices numbers the chunks
    after a zero-length entry wrong (fla-core 0.4.x, 0.5.0: the probe runs it on the CPU) computes garbage for such
    packs. gdn_compat's gdn_thd_zero_length (default on) takes exactly those calls; 0.16/0.17's gdn_thd drops empty
    entries itself."""
    if facts.gdn_thd is not Thd.NATIVE or facts.fla_zero_length is not Accepts.NO or facts.fla_error:
        return []
    return [Finding(
        "warning", "fla-zero-length-offsets",
        f"{facts.release} with {facts.fla}: packed offsets with zero-length entries (repeated values in cu_seqlens: a "
        f"fixed-count pack, an empty sample) give garbage or NaN in the release's own GDN forward, forward and "
        f"backward, because fla's prepare_chunk_indices numbers the chunks after an empty entry wrong "
        f"({facts.notes.get('fla_zero_length', '')}). gdn_compat.apply() fixes it: its gdn_thd_zero_length (on by "
        f"default) runs exactly those calls through gdn_compat's packed path.",
        "https://github.com/fla-org/flash-linear-attention",
        "gdn_compat.apply() (or GDN_COMPAT_AUTO=1); without gdn_compat, drop zero-length entries from cu_seqlens or "
        "use fla-core >= 0.5.1", fixed_by="gdn_thd_zero_length")]


FLASHQLA_FIXED = Version("0.1.3")  # fixed dg for strong decay and the SM90 backward tail padding


def _flashqla(facts: Facts) -> list[Finding]:
    """fla >= 0.5.2 sends chunk_gated_delta_rule to FlashQLA by itself whenever flash_qla imports (fla #998),
    whatever FlashQLA's version: megatron's own calls into fla included."""
    if facts.fla_flashqla_backend is not Accepts.YES or facts.flashqla is None or facts.fla_flashqla_off:
        return []
    version = _version(facts.flashqla.version)
    if version is not None and version < FLASHQLA_FIXED:
        return [Finding(
            "danger", "fla-auto-flashqla-old",
            f"{facts.fla} routes chunk_gated_delta_rule to FlashQLA by itself (fla #998), and the installed "
            f"{facts.flashqla} is older than 0.1.3: its dg is wrong for strong decay and its SM90 backward mishandles "
            f"tail padding, so GDN gradients can be silently wrong.",
            f"{FLA}/pull/998", "pip install 'flash-qla>=0.1.3', or FLA_FLASH_QLA=0 to keep fla's own kernels")]
    return [Finding(
        "info", "fla-auto-flashqla",
        f"{facts.fla} routes chunk_gated_delta_rule to {facts.flashqla} by itself (fla #998, with FlashQLA's "
        f"intra-card CP on); FLA_FLASH_QLA=0 turns that off. gdn_compat's own FlashQLA path is the opt-in "
        f"gdn_flashqla.", f"{FLA}/pull/998")]


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
            fix=FLA_FIX)]
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


def _gpu_generation(facts: Facts) -> list[Finding]:
    """Known GDN failures by GPU generation; a generation without a rule is said to be unverified."""
    if not _has_gdn(facts) or facts.gpu is None:
        return []
    gpu, major = facts.gpu, facts.gpu.capability[0]
    if facts.rocm:
        return [Finding(
            "warning", "rocm-gdn",
            f"{gpu} (ROCm {facts.rocm}): gdn_compat's kernels are not verified on ROCm. AMD Primus reports NaN "
            f"gradients in megatron-core's GDN backward on ROCm (Qwen3.5-35B-A3B) and works around them by "
            f"computing the gate in fp32 outside fla's kernel (use_gate_in_kernel=False).",
            "https://github.com/AMD-AGI/Primus/pull/937", "check the first backward for NaN gradients")]
    if major == VERIFIED_SM:
        return []
    if major != 10:
        return [Finding(
            "info", "gpu-not-verified",
            f"{gpu}: no known GDN kernel rule for this GPU generation, and gdn_compat's GPU suite runs on sm_90 "
            f"(H200) only: not verified on this GPU.")]
    out = [Finding(
        "info", "gpu-not-verified",
        f"{gpu} (Blackwell): gdn_compat's GPU suite runs on sm_90 (H200) only; the rules below come from fla's "
        f"and ms-swift's issue threads (ms-swift #8366 and #8435 report NaN grad norms training Qwen3.5 with "
        f"megatron-core 0.16.1).")]
    fla_v, triton_v = _version(facts.fla.version if facts.fla else None), _version(facts.triton)
    triton_base = Version(triton_v.base_version) if triton_v else None
    if triton_base is not None and BLACKWELL_COMPILE[0] <= triton_base < BLACKWELL_COMPILE[1]:
        out.append(Finding(
            "error", "fla-blackwell-compile",
            f"{gpu} with Triton {facts.triton}: fla's gated delta rule backward fails to compile on Blackwell "
            f"(\"Failed to hoist tmem_store\", \"operand #2 does not dominate this use\"; closed upstream as a "
            f"Triton bug), so the first GDN backward raises.",
            f"{FLA}/issues/607, {FLA}/issues/638", "use the Triton that your torch >= 2.12 ships (3.7)"))
    if fla_v is not None and fla_v >= Version("0.5.0") and triton_base is not None \
            and Version("3.7.0") <= triton_base < Version("3.8.0"):
        out.append(Finding(
            "danger", "fla-blackwell-nan",
            f"{gpu} with {facts.fla} and Triton {facts.triton}: fla #913 reports chunk_gated_delta_rule's backward "
            f"returning NaN gradients without an error on B200 / B300 (fla-core 0.5.0, Triton 3.7.0, torch 2.12; "
            f"also \"misaligned address\" crashes); the issue was closed as stale with no fix confirmed.",
            f"{FLA}/issues/913", "check the first steps' gradients for NaN before a long run"))
    if facts.fla_blackwell_wy_guard is Accepts.NO:
        out.append(Finding(
            "warning", "fla-blackwell-hang",
            f"{gpu} with {facts.fla}: GDN backward can hang at long sequences in prepare_wy_repr_bwd's autotune on "
            f"Blackwell (fla #999; in distributed runs it shows up later as an NCCL watchdog timeout); this fla lacks "
            f"the fix, fla PR #1000, which limits that autotune to one config on Blackwell.",
            f"{FLA}/issues/999", "install an fla-core that has PR #1000 (fla-core 0.6.0 does)"))
    return out


def _gdn_shapes(facts: Facts) -> list[Finding]:
    out = []
    if facts.gdn_legacy_shape:
        out.append(Finding(
            "info", "gdn-conv-path",
            f"{facts.release} runs unpacked GDN convolutions through {facts.gdn_conv}"
            + (" (slower than the causal_conv1d package)" if facts.gdn_conv is Conv.NN_CONV1D else "")
            + "; packed (THD) input through gdn_compat uses fla's varlen causal_conv1d."))
    # a broken fla breaks the import of megatron's GatedDeltaNet: fla-import says so, not an unknown shape
    for what, field, unknown in (("GatedDeltaNet", "gdn_thd", facts.gdn_thd is Thd.UNKNOWN and not facts.fla_error),
                                 ("MultiTokenPredictionLayer", "mtp", facts.mtp is Mtp.UNKNOWN)):
        if unknown:
            out.append(Finding(
                "warning", "unknown-shape",
                f"gdn_compat does not recognise this megatron-core's {what} ({facts.notes.get(field, 'unknown')}); "
                f"it patches nothing there."))
    # targets whose every known shape has a silent hole: an unknown shape may still have it
    if facts.mtp_roll is Roll.UNKNOWN:
        out.append(Finding(
            "warning", "unknown-shape-known-hole",
            f"gdn_compat does not recognise this megatron-core's packed MTP roll ({facts.notes.get('mtp_roll', 'unknown')}), "
            f"so mtp_packed_roll does not apply; every release up to 0.19.2 and upstream main at d98e8a6 roll a pack "
            f"laid out by cu_seqlens_q_padded by the unpadded offsets, a silently wrong MTP loss.",
            "https://github.com/NVIDIA/Megatron-LM/pull/4494",
            "check that MTP labels stay inside each sequence on a padded pack, or pack without alignment padding"))
    if _has_gdn(facts) and facts.gdn_out_norm_tp_sum is Accepts.UNKNOWN:
        out.append(Finding(
            "warning", "unknown-shape-known-hole",
            f"gdn_compat does not recognise this megatron-core's finalize_model_grads "
            f"({facts.notes.get('gdn_out_norm_tp_sum', 'unknown')}), so gdn_out_norm_tp_grad does not apply; every "
            f"release with GDN leaves the GDN out_norm grad partial at tp > 1 without sequence parallelism.",
            "https://github.com/NVIDIA/Megatron-LM/issues/7452",
            "compare the out_norm weights across tensor-parallel ranks after a few steps"))
    return out


def failing(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity in ("error", "danger")]
