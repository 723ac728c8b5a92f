"""What the probes must find on each real megatron-core release (the CPU-only signature tests).

The expectations are keyed by the release under test, which nox installs one per session; the
probes themselves never look at the version.
"""

from __future__ import annotations

import pytest

import gdn_compat
from gdn_compat._probe import Accepts
from tests.support.release import FACTS, MEGATRON

GDN_16 = dict(gdn="module", gdn_thd="refuses", gdn_cp="none", config=True, comm=Accepts.NO, mtp="generic",
              roll="by cu_seqlens_q",
              needs={"gdn_thd", "config_gdn_cp", "gdn_cp_comm_type", "gdn_out_norm_tp_grad",
                     "mtp_checkpoint_args", "mtp_packed_roll"})
GENERATION = {
    "0.15": dict(gdn="absent", gdn_thd="absent", gdn_cp="absent", config=False, comm=Accepts.ABSENT, mtp="generic",
                 roll="absent", needs={"mtp_checkpoint_args"}),
    "0.16": dict(GDN_16, backward_dw=Accepts.NO, needs=GDN_16["needs"] | {"gdn_backward_dw"}),
    "0.17": GDN_16,
    "0.18": dict(gdn="module", gdn_thd="native", gdn_cp="native", config=False, comm=Accepts.NO,
                 mtp="no_padding_mask", roll="by cu_seqlens_q",
                 needs={"gdn_cp_comm_type", "gdn_out_norm_tp_grad", "mtp_padding_mask", "mtp_packed_roll",
                        "gdn_thd_deterministic", "gdn_thd_cp_fused"}, cp_per_sequence=True),
    "0.19": dict(gdn="package", gdn_thd="native", gdn_cp="native", config=False, comm=Accepts.YES,
                 mtp="has_padding_mask", roll="by cu_seqlens_q",
                 needs={"gdn_out_norm_tp_grad", "mtp_packed_roll", "gdn_thd_deterministic"}),
    # upstream main (package_info 0.20.0, checked at d98e8a6 with ``nox -s source``): no release yet
    "0.20": dict(gdn="package", gdn_thd="native", gdn_cp="native", config=False, comm=Accepts.YES,
                 mtp="has_padding_mask", roll="by cu_seqlens_q", gate_method="_compute_gates",
                 needs={"gdn_out_norm_tp_grad", "mtp_packed_roll", "gdn_thd_deterministic"}),
}
release = ".".join((MEGATRON or "none").split(".")[:2])
expected = GENERATION.get(release)
pytestmark = pytest.mark.skipif(expected is None, reason=f"no expectations recorded for megatron-core {MEGATRON}")


def test_gdn_location():
    assert FACTS.gdn == expected["gdn"]


def test_gdn_thd_generation():
    assert FACTS.gdn_thd == expected["gdn_thd"]
    assert FACTS.gdn_legacy_shape == (expected["gdn_thd"] == "refuses")


def test_deterministic_thd_is_refused_exactly_where_thd_is_native():
    want = {"refuses": Accepts.ABSENT, "native": Accepts.NO, "absent": Accepts.ABSENT}[expected["gdn_thd"]]
    assert FACTS.gdn_thd_deterministic is want, FACTS.notes.get("gdn_thd_deterministic")


def test_gdn_context_parallel_in_the_layer_and_in_the_config():
    assert FACTS.gdn_cp == expected["gdn_cp"]
    assert FACTS.config_refuses_gdn_cp is expected["config"]
    assert FACTS.gdn_init_cp_comm_type is expected["comm"]
    # 0.18/0.19 assert that GDN's key and value heads divide tp x cp (config_gdn_cp narrows that with gdn_cp_state)
    if release != "0.20":  # main not checked since
        assert FACTS.config_gdn_heads_divide_cp is (expected["gdn_cp"] == "native")


def test_the_gate_exp_is_written_in_the_parameter_dtype_in_its_own_compiled_method_from_0_18():
    native = expected["gdn_thd"] == "native"
    assert FACTS.gdn_gate_exp == ("parameter dtype" if native else "absent")
    assert FACTS.gdn_gate_method == (expected.get("gate_method", "_compute_g_and_beta") if native else "")
    assert FACTS.gdn_gate_compiled == ("yes" if native else "absent")  # jit_fuser is torch.compile; dynamo on


def test_native_packed_cp_runs_per_sequence_only_on_0_18():
    assert FACTS.gdn_cp_per_sequence is expected.get("cp_per_sequence", False)


def test_gdn_backward_dw_is_missing_only_before_0_17():
    want = Accepts.ABSENT if expected["gdn"] == "absent" else expected.get("backward_dw", Accepts.YES)
    assert FACTS.gdn_backward_dw is want


def test_tp_reduction_of_gdn_out_norm_is_missing_wherever_gdn_exists():
    assert FACTS.gdn_out_norm_tp_sum is (Accepts.ABSENT if expected["gdn"] == "absent" else Accepts.NO)


def test_mtp_checkpointed_forward_generation():
    assert FACTS.mtp == expected["mtp"]


def test_mtp_roll_of_a_padded_pack_is_read_by_running_it():
    assert FACTS.mtp_roll == expected["roll"]


def test_exactly_the_needed_patches_are_selected():
    planned = {r.name for r in gdn_compat.plan(FACTS) if r.status == "would_apply"}
    assert planned == expected["needs"]


def test_skips_say_why():
    for rec in gdn_compat.plan(FACTS):
        if rec.name not in expected["needs"]:
            assert rec.status == "skipped" and (MEGATRON in rec.reason or "unknown" in rec.reason), rec


def test_fla_varlen_signatures_are_seen():
    if FACTS.fla is None or FACTS.fla_error:
        pytest.skip(f"fla not importable here: {FACTS.fla_error}")
    assert FACTS.fla_varlen.rule is Accepts.YES and FACTS.fla_varlen.conv is Accepts.YES


@pytest.mark.skipif(FACTS.gdn == "absent", reason=f"{FACTS.release} has no GatedDeltaNet")
def test_a_method_replaced_after_a_probe_is_read_anew_by_the_next(monkeypatch):
    """The probe reads each release function's source once (apply() and plan() ask every time); a function put in
    its place is another object, read on the next probe, and putting the release's back gives the first answer."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gdn_compat._probe import GDN_MODULE, probe

    cls = __import__(GDN_MODULE, fromlist=["GatedDeltaNet"]).GatedDeltaNet
    first = probe()
    assert (first.config_refuses_gdn_cp or first.config_gdn_heads_divide_cp) and first.gdn_thd in ("refuses", "native")

    def post_init(self):  # checks nothing
        pass

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None, **kwargs):
        return hidden_states  # neither refuses nor handles a pack

    with monkeypatch.context() as mp:
        mp.setattr(TransformerConfig, "__post_init__", post_init)
        mp.setattr(cls, "forward", forward)
        replaced = probe()
    assert not replaced.config_refuses_gdn_cp and not replaced.config_gdn_heads_divide_cp
    assert replaced.gdn_thd == "unknown", replaced.notes.get("gdn_thd")
    again = probe()
    assert (again.config_refuses_gdn_cp, again.config_gdn_heads_divide_cp, again.gdn_thd) == \
        (first.config_refuses_gdn_cp, first.config_gdn_heads_divide_cp, first.gdn_thd)
