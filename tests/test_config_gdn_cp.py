"""config_gdn_cp on the release's real TransformerConfig: on 0.16.x/0.17.x with gdn_thd (the cp == 1 assertion
lifted), on 0.18.x/0.19.x with gdn_cp_state (the heads checked against tp, not tp x cp; #56)."""

from __future__ import annotations

import linecache
import traceback

import pytest
import torch.nn.functional as F

import gdn_compat
from tests.support.release import FACTS, skip_reason

# 0.16/0.17: with gdn_thd (on by default)
LIFTS = pytest.mark.skipif(skip_reason("config_gdn_cp") is not None, reason=str(skip_reason("config_gdn_cp")))
# 0.18/0.19: with gdn_cp_state (opt-in)
NARROWS = pytest.mark.skipif(not FACTS.config_gdn_heads_divide_cp or skip_reason("config_gdn_cp", gdn_cp_state=True)
                             is not None, reason=f"{FACTS.release}'s TransformerConfig does not assert "
                                                 f"that GDN's heads divide tp x cp, or gdn_cp_state does not apply: "
                                                 f"{skip_reason('config_gdn_cp', gdn_cp_state=True)}")


def gdn_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, experimental_attention_variant="gated_delta_net",
              linear_attention_freq=2, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, normalization="RMSNorm", activation_func=F.silu,
              context_parallel_size=2, use_cpu_initialization=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


@LIFTS
def test_unpatched_release_refuses_context_parallel_with_gdn():
    with pytest.raises(AssertionError, match="Gated delta net does not support context parallel"):
        gdn_config()


@LIFTS
def test_patched_config_accepts_context_parallel_with_gdn():
    with gdn_compat.applied() as report:
        assert report["config_gdn_cp"].status == "applied"
        assert "context_parallel_size == 1" in report["config_gdn_cp"].reason
        cfg = gdn_config(cp_comm_type="p2p")
    assert cfg.context_parallel_size == 2
    with pytest.raises(AssertionError, match="does not support context parallel"):
        gdn_config()  # reverted: the release's own check is back


@LIFTS
@pytest.mark.parametrize("bad,match", [
    (dict(linear_num_value_heads=6, linear_num_key_heads=4), "must be a multiple of"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=6, tensor_model_parallel_size=2), "tensor_model_parallel_size"),
    (dict(cp_comm_type=["p2p"]), "Length of cp_comm_type"),
    (dict(linear_conv_kernel_dim=None), "linear_conv_kernel_dim must be set"),
])
def test_every_other_check_still_runs_and_points_at_the_release_source(bad, match):
    import megatron.core.transformer.transformer_config as release

    with gdn_compat.applied(), pytest.raises(AssertionError, match=match) as err:
        gdn_config(**bad)
    frame = traceback.extract_tb(err.value.__traceback__)[-1]
    assert frame.filename == release.__file__ and frame.name == "__post_init__"
    assert frame.line and frame.line.startswith("assert")  # the release's own line, by its line number
    text = linecache.getline(frame.filename, frame.lineno)
    assert frame.colno == len(text) - len(text.lstrip()), (frame.colno, text)  # and its own column: carets line up


@LIFTS
def test_without_gdn_thd_the_assertion_stays():
    with gdn_compat.applied(gdn_thd=False) as report:
        assert report["config_gdn_cp"].status == "skipped"
        assert report["config_gdn_cp"].reason.startswith("needs gdn_thd, which is skipped (disabled by")
        with pytest.raises(AssertionError, match="does not support context parallel"):
            gdn_config()


@LIFTS
def test_configs_without_cp_are_unchanged():
    plain = gdn_config(context_parallel_size=1)
    with gdn_compat.applied():
        patched = gdn_config(context_parallel_size=1)
    def fields(cfg):  # callables (init partials) compare by what they are, not by identity
        return {k: repr(v) if callable(v) else v for k, v in vars(cfg).items()}

    assert fields(plain) == fields(patched)


def _frame_is_the_release_assert(err) -> None:
    import megatron.core.transformer.transformer_config as release

    frame = traceback.extract_tb(err.value.__traceback__)[-1]
    assert frame.filename == release.__file__ and frame.name == "__post_init__"
    assert frame.line and frame.line.startswith("assert"), frame.line  # the release's own line, by its line number


@NARROWS
def test_unpatched_release_asserts_the_heads_divide_tp_times_cp():
    with pytest.raises(AssertionError, match=r"linear_num_key_heads=3 must be a multiple of"):
        gdn_config(linear_num_key_heads=3, linear_num_value_heads=6, context_parallel_size=4)
    with gdn_compat.applied() as report:  # gdn_cp_state off: the release's check stays
        assert report["config_gdn_cp"].status == "skipped"
        assert report["config_gdn_cp"].reason.startswith("needs gdn_cp_state, which is skipped")
        with pytest.raises(AssertionError, match=r"linear_num_key_heads=3 must be a multiple of"):
            gdn_config(linear_num_key_heads=3, linear_num_value_heads=6, context_parallel_size=4)


@NARROWS
def test_with_gdn_cp_state_heads_need_divide_only_tp_and_the_check_points_at_the_release_line():
    with gdn_compat.applied(gdn_cp_state=True) as report:
        assert report["config_gdn_cp"].status == "applied"
        assert "% tp" in report["config_gdn_cp"].reason
        cfg = gdn_config(linear_num_key_heads=3, linear_num_value_heads=6, context_parallel_size=4)
        assert (cfg.context_parallel_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (4, 3, 6)
        # tensor parallelism still splits heads: 3 key heads at tp = 2 are refused, by the release's line
        with pytest.raises(AssertionError, match=r"linear_num_key_heads=3 must be a multiple of "
                                                 r"self.tensor_model_parallel_size=2 \(gdn_compat gdn_cp_state") as err:
            gdn_config(linear_num_key_heads=3, linear_num_value_heads=6, context_parallel_size=1,
                       tensor_model_parallel_size=2)
        _frame_is_the_release_assert(err)
        with pytest.raises(AssertionError, match=r"must be a multiple of linear_num_key_heads"):  # the rest unchanged
            gdn_config(linear_num_key_heads=4, linear_num_value_heads=6)
    with pytest.raises(AssertionError, match=r"linear_num_key_heads=3 must be a multiple of"):
        gdn_config(linear_num_key_heads=3, linear_num_value_heads=6, context_parallel_size=4)  # reverted


@NARROWS
def test_with_gdn_cp_state_configs_whose_heads_divide_are_unchanged():
    plain = gdn_config(context_parallel_size=2, tensor_model_parallel_size=1)
    with gdn_compat.applied(gdn_cp_state=True):
        patched = gdn_config(context_parallel_size=2, tensor_model_parallel_size=1)

    def fields(cfg):
        return {k: repr(v) if callable(v) else v for k, v in vars(cfg).items()}

    assert fields(plain) == fields(patched)


CP_STATE = pytest.mark.skipif(skip_reason("gdn_cp_state", gdn_cp_state=True) is not None,
                              reason=str(skip_reason("gdn_cp_state", gdn_cp_state=True)))


class _TwoRanks:
    """A context-parallel group of two ranks, as far as a layer asks before its first collective."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


@CP_STATE
@pytest.mark.parametrize("hk,hv", [(3, 6), (1, 3)])
def test_with_gdn_cp_state_an_unpacked_call_that_would_split_heads_that_do_not_divide_cp_is_refused(hk, hv,
                                                                                                     megatron_cpu):
    """The config may now hold such heads (config_gdn_cp on 0.18/0.19, tp alone on 0.16/0.17): a call that would take
    the head all-to-all with them (here an unpacked one) is an error naming the numbers, before any collective."""
    import torch

    from gdn_compat.patches.gdn_cp_state import split_refusal
    from tests.support.gdn import build_gdn

    with gdn_compat.applied(gdn_cp_state=True):
        layer = build_gdn(hk=hk, hv=hv, cp_group=_TwoRanks())
        with pytest.raises(ValueError, match=rf"its {hk} key and {hv} value heads do not divide tp x cp = 1 x 2"):
            layer(torch.randn(8, 1, 64), attention_mask=None)
    assert split_refusal(build_gdn(hk=2, hv=4, cp_group=_TwoRanks())) is None  # heads that divide: the release's way
