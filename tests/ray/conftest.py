"""A local Ray cluster for the tests of stoker.ray: started once per test process on
127.0.0.1 with two CPUs, stopped after them. Its workers import stoker as installed, and
the repository's root (for tests.support) is on their path."""

from __future__ import annotations

import os

import pytest

from tests.support import REPO

ray = pytest.importorskip("ray")
ray_data = pytest.importorskip("ray.data")


@pytest.fixture(scope="package")
def ray_cluster():
    """The address of a running local cluster (this process is its driver), stopped once
    the package's tests are done: its processes would slow the tests that follow."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    if os.environ.get("STOKER_CACHE"):
        env["STOKER_CACHE"] = os.environ["STOKER_CACHE"]
    context = ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 << 20,
        runtime_env={"env_vars": env},
    )
    ray_data.DataContext.get_current().enable_progress_bars = False
    try:
        yield context.address_info["address"]
    finally:
        ray.shutdown()
