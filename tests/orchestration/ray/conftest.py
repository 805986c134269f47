"""One Ray cluster for the whole session (starting one takes ~10 s on 2 cores): local, no
dashboard, a small object store; actors reserve no CPUs."""

import os

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="session")
def ray_cluster():
    from rltt.orchestration.ray.cluster import ZERO_COPY, actor_env

    os.environ.update(ZERO_COPY)
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 * 1024**2,
                 log_to_driver=False, runtime_env={"env_vars": actor_env(1)})
    yield ray
    if started:
        ray.shutdown()
