"""setuptools glue for the one thing pyproject.toml cannot say: ship ``gdn_compat_auto.pth`` at the top of the wheel
(site-packages), where Python's ``site`` module reads it at interpreter start (see ``_gdn_compat_auto.py``), in the
regular wheel and in the editable one (``pip install -e .``, ``uv pip install -e .``: PEP 660) alike."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "gdn_compat_auto.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


commands = {"build_py": BuildPyWithPth}

try:  # setuptools >= 64: editable wheels are written by a strategy object; ours adds the .pth beside its own files
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # pragma: no cover - an older setuptools has no PEP 660 wheels: nothing to add to
    editable_wheel = None


class _WithPth:
    """The editable strategy setuptools chose (a path .pth, a finder, a link tree), plus our .pth in the wheel."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, wheel, files, mapping):
        self.inner(wheel, files, mapping)
        with open(os.path.join(HERE, PTH)) as f:
            wheel.writestr(PTH, f.read())

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):
    class EditableWheelWithPth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _WithPth(super()._select_strategy(*args, **kwargs))

    commands["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=commands)
