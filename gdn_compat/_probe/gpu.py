"""The GPU, where asking is harmless (CUDA already initialised, or the doctor's own process)."""

from __future__ import annotations

from typing import Any

from gdn_compat._probe.facts import Gpu, _why


def _probe_gpu(out: dict[str, Any], torch: Any, init_cuda: bool) -> None:
    try:
        if not torch.cuda.is_available():
            out["notes"]["gpu"] = "no CUDA device"
        elif not (init_cuda or torch.cuda.is_initialized()):
            # Asking for the capability creates a CUDA context; before the user picked a device
            # that context would land on GPU 0 for every rank. The doctor asks in its own process.
            out["notes"]["gpu"] = "not inspected: CUDA not initialised yet (run `python -m gdn_compat` on the GPU node)"
        else:
            out["gpu"] = Gpu(torch.cuda.get_device_name(), tuple(torch.cuda.get_device_capability()))
    except Exception as exc:  # noqa: BLE001
        out["notes"]["gpu"] = f"not inspected: {_why(exc)}"
