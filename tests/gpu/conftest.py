import pytest

try:
    import torch

    HAVE_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    HAVE_CUDA = False
try:
    import fla.ops.gated_delta_rule  # noqa: F401

    HAVE_FLA = True
except Exception:  # noqa: BLE001 - missing or broken fla both mean: no GPU kernels here
    HAVE_FLA = False


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA and HAVE_FLA:
        return
    why = "needs CUDA" if not HAVE_CUDA else "needs an importable fla"
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=f"GPU suite {why}"))
