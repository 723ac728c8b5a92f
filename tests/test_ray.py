"""GDN_COMPAT_AUTO through Ray (#29): actors that never import gdn_compat, started by a local Ray cluster (CPU),
get gdn_compat's patches from ``runtime_env`` alone: the variable in an actor's ``env_vars``, or
``worker_process_setup_hook="gdn_compat.auto"`` in the job's runtime_env (Ray takes the hook at job level only); an
actor with neither gets the release's NotImplementedError.
Needs ``ray`` and gdn_compat installed from its wheel (``nox -s ray``); the actor runs tests/support/auto_child.py's
``run()`` from its source text, so nothing of this test package is imported in the worker.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import sys
import tempfile

import pytest

from tests.support.release import FACTS, MEGATRON

ray = pytest.importorskip("ray", reason="ray is a test-only dependency of the ray nox session")
pytestmark = pytest.mark.skipif(FACTS.gdn_thd != "refuses", reason=f"megatron-core {MEGATRON} packs GDN natively")
CHILD = (pathlib.Path(__file__).resolve().parent / "support" / "auto_child.py").read_text()


@contextlib.contextmanager
def local_cluster(**job_env):
    """A local Ray cluster (2 CPUs) whose job-level runtime_env holds ``job_env`` (as a framework's ray.init would)."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor travels by value
    if ray.is_initialized():
        ray.shutdown()
    # Ray refuses a temp dir inside the virtualenv, where nox points TMPDIR; short, for its socket paths
    temp = tempfile.mkdtemp(prefix="gdn-ray-", dir="/tmp")
    env_vars = {"TORCH_CUDA_ARCH_LIST": "9.0", **job_env.pop("env_vars", {})}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp,
             runtime_env={"env_vars": env_vars, **job_env})
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster():
        yield


class Trainer:
    def run(self, source: str) -> dict:
        namespace: dict = {"__name__": "auto_child"}
        exec(compile(source, "auto_child.py", "exec"), namespace)  # noqa: S102 - our own file's text
        return namespace["run"]()


def _in_actor(runtime_env: dict) -> dict:
    actor = ray.remote(num_cpus=0)(Trainer).options(runtime_env=runtime_env).remote()
    try:
        return ray.get(actor.run.remote(CHILD), timeout=300)
    finally:
        ray.kill(actor)


def test_an_actor_given_the_variable_in_runtime_env_is_patched(cluster):
    got = _in_actor({"env_vars": {"GDN_COMPAT_AUTO": "1", "TORCH_CUDA_ARCH_LIST": "9.0"}})
    assert got["ok"] and got["grad_finite"] and "gdn_thd" in got["gdn_compat"]["applied"], got


def test_an_actor_with_neither_gets_the_release_error(cluster):
    got = _in_actor({"env_vars": {"TORCH_CUDA_ARCH_LIST": "9.0"}})
    assert not got["ok"] and got["error"].startswith("NotImplementedError") and got["gdn_compat"] is None, got


def test_a_job_given_the_setup_hook_patches_its_actors():
    """Ray runs ``worker_process_setup_hook`` for a job-level runtime_env (ray.init), in every worker it starts."""
    with local_cluster(worker_process_setup_hook="gdn_compat.auto"):
        got = _in_actor({})
    assert got["ok"] and "gdn_thd" in got["gdn_compat"]["applied"], got
