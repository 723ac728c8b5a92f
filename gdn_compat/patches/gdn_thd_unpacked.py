"""gdn_thd_unpacked (opt-in, megatron-core 0.16.x/0.17.x): unpacked GDN calls through the packed path's kernels.

On 0.16/0.17 gdn_thd gives packed calls 0.18/0.19's kernels (fla's varlen conv, the compiled gate, fla's delta
rule), so they are bitwise native 0.19.2; unpacked calls stay the release's own code, which convolves with a
bf16 ``nn.Conv1d`` (without the causal-conv1d package) and takes the gate's exp of A_log in bf16 inline. The
two agree to about one bf16 step, not to the 3e-4 of upstream's own THD tests (PR #2645:
``test_gpu_forward_thd_correctness``, ``..._padding_correctness``: a pack against the same layer run
unpacked). With this switch on, every unpacked call without an inference context runs gdn_compat's packed
path with each batch row as one sequence: the same kernels and gate as packed calls, so packed training and
unpacked evaluation of one model agree (README: measured). Off by default: the release's unpacked path stays
its own code unless asked. ``apply(gdn_thd_unpacked=True)`` or ``GDN_COMPAT_ENABLE=gdn_thd_unpacked``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from gdn_compat._probe import GDN_MODULE, Facts, Thd
from gdn_compat._registry import Patch, Target
from gdn_compat.patches.gdn_thd import context_parallel as cpx
from gdn_compat.patches.gdn_thd import decide as gdn_thd_skip
from gdn_compat.patches.gdn_thd import fast_below, pack_of, packed_forward
from gdn_compat.patches.gdn_thd.kernels import Core


def decide(facts: Facts) -> str | None:
    if facts.gdn_thd is Thd.NATIVE:
        return (f"{facts.release} runs unpacked GDN calls through the same fla kernels and compiled gate as packed "
                f"ones already")
    return gdn_thd_skip(facts)


def build(facts: Facts, original: Any) -> Any:
    core = Core(sys.modules[original.__module__], facts.fla_varlen, facts.fla_atomic_free, fast_below(original))

    @functools.wraps(original)
    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                inference_params=None, **kwargs):
        packed = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) == "thd"
        if packed or inference_context is not None or inference_params is not None:
            return original(self, hidden_states, attention_mask, key_value_states, inference_context,
                            attention_bias, packed_seq_params, sequence_len_offset,
                            inference_params=inference_params, **kwargs)
        cp = cpx.size_of(self)
        return packed_forward(self, core, hidden_states, pack_of(self, hidden_states, None, cp), cp)

    return forward


PATCH = Patch(
    name="gdn_thd_unpacked",
    target=Target(GDN_MODULE, "GatedDeltaNet", "forward"),
    decide=decide,
    build=build,
    summary="unpacked GatedDeltaNet calls (each batch row one sequence) run gdn_compat's packed path: the kernels "
            "and gate packed calls use, as upstream's THD tests expect (PR #2645); inference is the release's",
    requires=("gdn_thd",),
    opt_in=True,
)
