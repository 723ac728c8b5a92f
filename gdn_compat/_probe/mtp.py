"""MultiTokenPredictionLayer: the shape of its ``_checkpointed_forward``, and how its roll of a packed micro-batch
finds sequence boundaries (read by running it on a tiny CPU pack)."""

from __future__ import annotations

import inspect
import re
from typing import Any

from gdn_compat._probe.facts import MTP_MODULE, Mtp, Roll, _import, _why, source

_PASSES_MASK = re.compile(r"self\._checkpointed_forward\((?:[^()]|\([^()]*\))*padding_mask\s*=", re.S)


def _mtp_shape(cls: Any) -> tuple[Mtp, str]:
    ckpt = dict(inspect.signature(cls._checkpointed_forward).parameters)
    fwd_src = source(cls.forward)
    layer = cls.__dict__.get("_proj_and_transformer_layer")
    layer_params = inspect.signature(layer).parameters if layer else {}
    if "forward_func" in ckpt:
        return Mtp.GENERIC, ""
    if "padding_mask" in ckpt:
        return Mtp.HAS_PADDING_MASK, ""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ckpt.values()):
        return Mtp.UNKNOWN, "_checkpointed_forward takes **kwargs"
    if not _PASSES_MASK.search(fwd_src):
        return Mtp.UNKNOWN, "forward does not pass padding_mask to _checkpointed_forward"
    if "padding_mask" not in layer_params:
        return Mtp.UNKNOWN, "_proj_and_transformer_layer takes no padding_mask"
    return Mtp.NO_PADDING_MASK, ""


ROLL_PARAMS = ("tensor", "shifts", "dims", "packed_seq_params", "cp_group")  # 0.16-0.19; main adds return_sum


def _roll_shape(mod: Any) -> tuple[Roll, str]:
    """Run the release's packed roll once on a tiny CPU pack laid out by padded slots: sequences of
    2 and 3 tokens in slots of 4, values 1..8. Rolling by the padded slots gives [2,0,0,0, 6,7,0,0];
    by the unpadded offsets [0,2,5] (the hole) it gives [2,0, 4,5,0, 6,7,8]."""
    import types

    import torch

    func, roll = mod.__dict__.get("_roll_tensor_packed_seq"), mod.__dict__.get("roll_tensor")
    if func is None or roll is None:
        return Roll.ABSENT, ""
    params = tuple(inspect.signature(func).parameters)
    if params not in (ROLL_PARAMS, (*ROLL_PARAMS, "return_sum")):
        return Roll.UNKNOWN, f"_roll_tensor_packed_seq{inspect.signature(func)} is not {ROLL_PARAMS} (+ return_sum)"
    if not re.search(r"\breturn\s+_roll_tensor_packed_seq\(", source(roll)):
        return Roll.UNKNOWN, "roll_tensor does not hand packed input to _roll_tensor_packed_seq"
    unpadded, padded = torch.tensor([0, 2, 5]), torch.tensor([0, 4, 8])
    psp = types.SimpleNamespace(qkv_format="thd", cu_seqlens_q=unpadded, cu_seqlens_kv=unpadded,
                                cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    try:
        got = func(torch.arange(1, 9)[None], -1, -1, psp, None)[0][0].tolist()
    except Exception as exc:  # noqa: BLE001 - an unknown shape, not a crash
        return Roll.UNKNOWN, f"_roll_tensor_packed_seq failed on a padded pack: {_why(exc)}"
    if got == [2, 0, 0, 0, 6, 7, 0, 0]:
        return Roll.PADDED, ""
    if got == [2, 0, 4, 5, 0, 6, 7, 8]:
        return Roll.UNPADDED, ""
    return Roll.UNKNOWN, f"_roll_tensor_packed_seq rolls a padded pack in an unknown way: {got}"


def _probe_mtp(out: dict[str, Any]) -> None:
    mod = _import(MTP_MODULE, out, "mtp")
    if mod is None:
        if out.get("mtp") == "unknown":
            out["mtp_roll"] = Roll.UNKNOWN
        return
    try:
        out["mtp_roll"], note = _roll_shape(mod)
    except (TypeError, OSError, ValueError) as exc:
        out["mtp_roll"], note = Roll.UNKNOWN, f"cannot read _roll_tensor_packed_seq: {_why(exc)}"
    if note:
        out["notes"]["mtp_roll"] = note
    cls = getattr(mod, "MultiTokenPredictionLayer", None)
    try:
        if cls is None or not hasattr(cls, "_checkpointed_forward"):
            raise LookupError("MultiTokenPredictionLayer._checkpointed_forward not found")
        out["mtp"], note = _mtp_shape(cls)
    except (LookupError, TypeError, OSError, ValueError) as exc:
        out["mtp"], note = Mtp.UNKNOWN, f"cannot read MultiTokenPredictionLayer: {_why(exc)}"
    if note:
        out["notes"]["mtp"] = note
