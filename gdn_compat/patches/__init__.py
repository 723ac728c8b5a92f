"""The patches, in the order ``apply()`` decides and installs them.

A patch is one module (``mtp_padding_mask.py``) or, when large, one package (``gdn_thd/``) whose
``__init__`` holds the decision and the wiring. Each exposes ``PATCH``.
"""

from gdn_compat.patches import (
    config_gdn_cp,
    gdn_backward_dw,
    gdn_cp_comm_type,
    gdn_cp_state,
    gdn_flashqla,
    gdn_fused,
    gdn_gate_fp32,
    gdn_out_norm_tp_grad,
    gdn_thd,
    gdn_thd_cp_fused,
    gdn_thd_deterministic,
    gdn_thd_graph_safe,
    gdn_thd_unpacked,
    gdn_thd_zero_length,
    mtp_checkpoint_args,
    mtp_packed_roll,
    mtp_padding_mask,
)

PATCHES = (gdn_thd.PATCH, gdn_thd_deterministic.PATCH, gdn_thd_graph_safe.PATCH, gdn_thd_cp_fused.PATCH,
           gdn_thd_zero_length.PATCH, gdn_flashqla.PATCH, gdn_fused.PATCH, gdn_cp_state.PATCH, gdn_thd_unpacked.PATCH, config_gdn_cp.PATCH,
           gdn_cp_comm_type.PATCH, gdn_out_norm_tp_grad.PATCH, gdn_backward_dw.PATCH, gdn_gate_fp32.PATCH, mtp_checkpoint_args.PATCH,
           mtp_packed_roll.PATCH, mtp_padding_mask.PATCH)
