"""setuptools glue for the one thing pyproject.toml cannot say: ship ``gdn_compat_auto.pth`` at the top of the wheel
(site-packages), where Python's ``site`` module reads it at interpreter start (see ``_gdn_compat_auto.py``)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "gdn_compat_auto.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
