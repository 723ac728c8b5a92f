"""Hazard rules as a pure function of the probe record, at each rule's boundaries."""

from __future__ import annotations

import dataclasses

import pytest

from gdn_compat._probe import Accepts, Conv, Dist, Facts, Gpu, Layout, Mtp, Roll, Thd, Varlen
from gdn_compat.hazards import check, failing

HOPPER = dict(gpu=Gpu("NVIDIA H200", (9, 0)))
VARLEN = Varlen(Accepts.YES, Accepts.YES, Accepts.YES, Accepts.YES)
GDN = dict(megatron=Dist("megatron-core", "0.17.1"), gdn=Layout.MODULE, gdn_thd=Thd.REFUSES, gdn_legacy_shape=True,
           gdn_conv=Conv.NN_CONV1D, mtp=Mtp.GENERIC, fla_varlen=VARLEN)


def facts(triton="3.6.0", fla="0.4.2", gpu=HOPPER, **kw):
    base = dict(python="3.12", torch="2.11.0", triton=triton, fla=Dist("fla-core", fla) if fla else None,
                **GDN, **gpu)
    base.update(kw)
    return Facts(**base)


def codes(f, **kw):
    return {x.code: x.severity for x in check(f, **kw)}


@pytest.mark.parametrize("triton,bad", [("3.3.1", False), ("3.4.0", True), ("3.6.0", True), ("3.7.0", True),
                                        ("3.7.1", False), ("3.9.0", False)])
@pytest.mark.parametrize("fla,sev", [("0.4.2", "danger"), ("0.5.0", "error"), ("0.6.0", "error")])
def test_hopper_triton_range_and_fla_version(triton, bad, fla, sev):
    found = codes(facts(triton=triton, fla=fla))
    code = "fla-640-crash" if sev == "error" else "fla-640-miscompile"
    assert (found.get(code) == sev) == bad, found


@pytest.mark.parametrize("cap", [(8, 0), (10, 0)])
def test_other_architectures_are_not_flagged(cap):
    found = codes(facts(fla="0.6.0", gpu=dict(gpu=Gpu("X", cap))))
    assert not {"fla-640-crash", "fla-640-miscompile", "fla-640-unchecked"} & set(found)


@pytest.mark.parametrize("dk,sev", [(64, "danger"), (33, "danger"), (32, "info"), (128, "info"), (None, "danger")])
def test_old_fla_miscompile_depends_on_key_head_dim(dk, sev):
    assert codes(facts(fla="0.4.2"), key_head_dim=dk)["fla-640-miscompile"] == sev


def test_tilelang_avoids_the_crash():
    assert "fla-640-crash" not in codes(facts(fla="0.6.0", tilelang="0.1.6"))


def test_unknown_gpu_gets_a_hint_not_a_verdict():
    found = codes(facts(gpu=dict(gpu=None, notes={"gpu": "not inspected: CUDA not initialised yet"})))
    assert found.get("fla-640-unchecked") == "info"
    assert not failing(check(facts(gpu=dict(gpu=None, notes={"gpu": "no CUDA device"}))))


def test_fla_missing_with_gdn_is_an_error_and_without_gdn_is_not():
    assert codes(facts(fla=None))["fla-missing"] == "error"
    assert "fla-missing" not in codes(facts(fla=None, gdn=Layout.ABSENT, gdn_thd=Thd.ABSENT, gdn_legacy_shape=False))


def test_fla_that_fails_to_import_is_an_error_naming_the_reason():
    [f] = [x for x in check(facts(fla_error="ValueError: key contains names that are not kernel arguments: STAGE"))
           if x.code == "fla-import"]
    assert f.severity == "error" and "STAGE" in f.message


def test_fla_without_varlen_is_an_error():
    assert codes(facts(fla_varlen=dataclasses.replace(VARLEN, rule=Accepts.NO)))["fla-no-varlen"] == "error"


def test_conv_path_is_reported_for_legacy_gdn():
    assert codes(facts())["gdn-conv-path"] == "info"
    f = dataclasses.replace(facts(), gdn_legacy_shape=False)
    assert "gdn-conv-path" not in codes(f)


def test_unknown_shapes_are_warnings():
    assert codes(facts(mtp=Mtp.UNKNOWN, notes={"mtp": "_checkpointed_forward takes **kwargs"}))["unknown-shape"] == "warning"


def test_findings_carry_source_and_fix():
    [f] = [x for x in check(facts(fla="0.6.0")) if x.code == "fla-640-crash"]
    assert "issues/640" in f.source and "3.7.1" in f.fix


# -- GPU generations (#22 item 1): Blackwell from fla's threads, ROCm, and "not verified" elsewhere ------------

BLACKWELL = dict(gpu=Gpu("NVIDIA B200", (10, 0)))


@pytest.mark.parametrize("triton,bad", [("3.3.1", False), ("3.4.0", True), ("3.5.1", True), ("3.6.0", False)])
def test_blackwell_backward_compile_failures_by_triton(triton, bad):
    assert (codes(facts(triton=triton, gpu=BLACKWELL)).get("fla-blackwell-compile") == "error") == bad


@pytest.mark.parametrize("fla,triton,bad", [("0.5.0", "3.7.0", True), ("0.6.0", "3.7.1", True), ("0.4.2", "3.7.0", False),
                                            ("0.5.0", "3.6.0", False), ("0.6.0", "3.8.0", False)])
def test_blackwell_silent_nan_gradients_reported_for_fla_0_5_with_triton_3_7(fla, triton, bad):
    found = codes(facts(fla=fla, triton=triton, gpu=BLACKWELL))
    assert (found.get("fla-blackwell-nan") == "danger") == bad, found


@pytest.mark.parametrize("guard,warned", [(Accepts.NO, True), (Accepts.YES, False), (Accepts.UNKNOWN, False)])
def test_blackwell_backward_hang_where_fla_lacks_the_autotune_guard(guard, warned):
    found = codes(facts(fla="0.6.0", triton="3.7.1", gpu=BLACKWELL, fla_blackwell_wy_guard=guard))
    assert ("fla-blackwell-hang" in found) == warned
    assert "fla-blackwell-hang" not in codes(facts(gpu=HOPPER, fla_blackwell_wy_guard=Accepts.NO))


@pytest.mark.parametrize("cap,said", [((9, 0), False), ((8, 0), True), ((12, 0), True), ((10, 3), True)])
def test_a_gpu_generation_without_a_verified_run_says_so(cap, said):
    assert (codes(facts(gpu=dict(gpu=Gpu("X", cap)))).get("gpu-not-verified") == "info") == said


def test_rocm_is_a_warning_naming_the_known_nan_report():
    [f] = [x for x in check(facts(rocm="6.4.1", gpu=dict(gpu=Gpu("AMD Instinct MI300X", (9, 4)))))
           if x.code == "rocm-gdn"]
    assert f.severity == "warning" and "Primus/pull/937" in f.source and "use_gate_in_kernel=False" in f.message


def test_gpu_rules_need_gdn():
    none = dict(gdn=Layout.ABSENT, gdn_thd=Thd.ABSENT, gdn_legacy_shape=False)
    assert not {"fla-blackwell-compile", "gpu-not-verified"} & set(codes(facts(triton="3.4.0", gpu=BLACKWELL, **none)))


def test_the_installed_fla_guard_is_read_from_its_source():
    from packaging.version import Version

    from gdn_compat import probe
    from gdn_compat._probe import _WY_GUARD

    assert _WY_GUARD.search("PREPARE_WY_REPR_BWD_NUM_WARPS = [2] if IS_NVIDIA_BLACKWELL else [2, 4]")
    assert not _WY_GUARD.search("configs=[triton.Config({}, num_warps=w) for w in [2, 4]]")  # fla 0.4.2's shape
    f = probe()
    if f.fla is None or f.fla_error or Version(f.fla.version) < Version("0.6.0"):
        pytest.skip(f"needs fla-core >= 0.6.0 (read: it carries PR #1000), have {f.fla}")
    assert f.fla_blackwell_wy_guard is Accepts.YES


def test_an_unknown_shape_of_a_target_with_a_known_hole_is_a_warning_naming_the_hole():
    found = {x.code: x for x in check(facts(mtp_roll=Roll.UNKNOWN, notes={"mtp_roll": "new signature"}))}
    assert found["unknown-shape-known-hole"].severity == "warning"
    assert "new signature" in found["unknown-shape-known-hole"].message and "4494" in found["unknown-shape-known-hole"].source
    assert "unknown-shape-known-hole" not in codes(facts(mtp_roll=Roll.UNPADDED))
    tp = {x.code: x for x in check(facts(gdn_out_norm_tp_sum=Accepts.UNKNOWN))}
    assert "7452" in tp["unknown-shape-known-hole"].source


@pytest.mark.parametrize("version,off,code,sev", [("0.1.2", False, "fla-auto-flashqla-old", "danger"),
                                                  ("0.1.3", False, "fla-auto-flashqla", "info"),
                                                  ("0.1.2", True, None, None)])
def test_fla_routing_to_an_old_flashqla_by_itself_is_a_danger(version, off, code, sev):
    f = facts(fla="0.6.0", fla_flashqla_backend=Accepts.YES, flashqla=Dist("flash-qla", version), fla_flashqla_off=off)
    got = {k: v for k, v in codes(f).items() if "flashqla" in k}
    assert got == ({code: sev} if code else {})
    assert not {k for k in codes(facts(fla="0.6.0", flashqla=Dist("flash-qla", "0.1.2"))) if "flashqla" in k}


@pytest.mark.parametrize("thd", [Thd.NATIVE, Thd.REFUSES])
@pytest.mark.parametrize("found", [Accepts.NO, Accepts.YES, Accepts.UNKNOWN])
def test_zero_length_offsets_are_named_where_the_native_path_meets_a_wrong_fla_table(thd, found):
    f = facts(megatron=Dist("megatron-core", "0.19.2" if thd is Thd.NATIVE else "0.17.1"), gdn_thd=thd,
              fla_zero_length=found, notes={"fla_zero_length": "prepare_chunk_indices(...) = [[0, 0], [1, 0]]"})
    named = [x for x in check(f) if x.code == "fla-zero-length-offsets"]
    assert bool(named) == (thd is Thd.NATIVE and found is Accepts.NO)
    for x in named:  # the stack in the message, fixed by apply(): not a failing exit on its own
        assert "megatron-core 0.19.2" in x.message and "fla-core 0.4.2" in x.message and x not in failing([x])
