"""config_gdn_cp on the release's real TransformerConfig (0.16.x/0.17.x; skipped elsewhere)."""

from __future__ import annotations

import linecache
import traceback

import pytest
import torch.nn.functional as F

import gdn_compat
from tests.support.release import skip_reason

pytestmark = pytest.mark.skipif(skip_reason("config_gdn_cp") is not None, reason=str(skip_reason("config_gdn_cp")))


def gdn_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=2, hidden_size=64, num_attention_heads=4, experimental_attention_variant="gated_delta_net",
              linear_attention_freq=2, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, normalization="RMSNorm", activation_func=F.silu,
              context_parallel_size=2, use_cpu_initialization=True)
    kw.update(overrides)
    return TransformerConfig(**kw)


def test_unpatched_release_refuses_context_parallel_with_gdn():
    with pytest.raises(AssertionError, match="Gated delta net does not support context parallel"):
        gdn_config()


def test_patched_config_accepts_context_parallel_with_gdn():
    with gdn_compat.applied() as report:
        assert report["config_gdn_cp"].status == "applied"
        assert "context_parallel_size == 1" in report["config_gdn_cp"].reason
        cfg = gdn_config(cp_comm_type="p2p")
    assert cfg.context_parallel_size == 2
    with pytest.raises(AssertionError, match="does not support context parallel"):
        gdn_config()  # reverted: the release's own check is back


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


def test_without_gdn_thd_the_assertion_stays():
    with gdn_compat.applied(gdn_thd=False) as report:
        assert report["config_gdn_cp"].status == "skipped"
        assert report["config_gdn_cp"].reason.startswith("needs gdn_thd, which is skipped (disabled by")
        with pytest.raises(AssertionError, match="does not support context parallel"):
            gdn_config()


def test_configs_without_cp_are_unchanged():
    plain = gdn_config(context_parallel_size=1)
    with gdn_compat.applied():
        patched = gdn_config(context_parallel_size=1)
    def fields(cfg):  # callables (init partials) compare by what they are, not by identity
        return {k: repr(v) if callable(v) else v for k, v in vars(cfg).items()}

    assert fields(plain) == fields(patched)
