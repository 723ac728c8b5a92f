"""The patches, in the order ``apply()`` runs them. One file per patch: its probe decision and replacement."""

from gdn_compat.patches import gdn_thd, mtp_padding_mask

PATCHES = (gdn_thd.PATCH, mtp_padding_mask.PATCH)
