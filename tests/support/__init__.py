"""Test, benchmark and example support: one home outside the installed package.

``tests.support.megatron`` (process groups, CPU stand-ins), ``tests.support.gdn`` (a release
GatedDeltaNet, an independent reference, packed runs), ``tests.support.mtp`` (a GPTModel with MTP),
``tests.support.compat_table`` (the README table from the doctor's JSON, stdlib only),
``tests.support.release`` (the release under test, its probe and plan).
"""

