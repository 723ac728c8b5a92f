"""FlashQLA (flash-qla), read from its files without importing it (its import initialises CUDA and asks tilelang for
the GPU): the version, whether its source holds atomics, whether it takes a pack's chunk metadata from its offsets."""

from __future__ import annotations

import importlib.metadata as md
from typing import Any

from gdn_compat._probe.facts import Accepts, _dist, _why
from gdn_compat._probe.fla import _ATOMIC


def _probe_flashqla(out: dict[str, Any]) -> None:
    """FlashQLA without importing it (its import initialises CUDA and asks tilelang for the GPU): the version,
    and whether its source files hold atomics (each kernel then sums in a fixed order)."""
    out["flashqla"] = found = _dist("flash-qla", "flash_qla")
    if found is None:
        return
    try:
        files = [f for f in md.distribution(found.name).files or () if str(f).endswith(".py")]
        hits = sorted({h for f in files for h in _ATOMIC.findall(f.read_text() or "")})
    except Exception as exc:  # noqa: BLE001 - unreadable: nothing proves it atomic-free
        out["flashqla_atomic_free"] = Accepts.UNKNOWN
        out["notes"]["flashqla_atomic_free"] = f"FlashQLA's files not readable: {_why(exc)}"
        return
    out["flashqla_atomic_free"] = Accepts.NO if hits or not files else Accepts.YES
    out["notes"]["flashqla_atomic_free"] = (f"{len(files)} files read; " + (f"atomics: {', '.join(hits)}" if hits
                                            else "none has atomics or scatter-adds"))
    index = next((f for f in files if str(f).replace("\\", "/").endswith("flash_qla/utils/index.py")), None)
    text = (index.read_text() or "") if index is not None else ""
    out["flashqla_metadata"], out["notes"]["flashqla_metadata"] = _flashqla_metadata(text)


FLASHQLA_METADATA = "_flash_qla_prepared_varlen"


def _flashqla_metadata(source: str) -> tuple[Accepts, str]:
    """Whether FlashQLA's index helpers (``flash_qla/utils/index.py``) take a pack's chunk metadata from an attribute
    of its offsets tensor, as (chunk size, chunk offsets, chunk count, chunk indices), before any cache or host read
    (flash-qla 0.1.3's ``prepare_varlen_metadata`` attaches it so; ``prepare_chunk_indices`` returns ``prepared[3]``,
    ``prepare_chunk_offsets`` ``prepared[1:3]``). Then gdn_compat can attach metadata built by device ops, of fixed
    size, and a CUDA graph of a FlashQLA step replays any layout."""
    if not source:
        return Accepts.UNKNOWN, "flash_qla/utils/index.py not found among its files"
    wanted = (f'getattr(cu_seqlens, "{FLASHQLA_METADATA}", None)', "return prepared[3]", "return prepared[1:3]",
              "prepared[0] == chunk_size")
    missing = [w for w in wanted if w not in source]
    if missing:
        return Accepts.NO, f"flash_qla/utils/index.py lacks {missing}: chunk metadata is read on the host"
    return Accepts.YES, f"flash_qla/utils/index.py reads {FLASHQLA_METADATA} (size, offsets, count, indices)"
