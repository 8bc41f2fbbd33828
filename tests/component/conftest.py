from __future__ import annotations

import contextlib
import time

import pytest

from tests.support.multinode import REPO, run_checks_on_a_local_cluster
from tests.support.prefect_server import prefect_harness  # noqa: F401  (in-process flows, one temporary server)
from tests.support.s3_fixtures import (  # noqa: F401  (storage fixtures: moto, fault proxy, HF Hub server)
    fault_proxy, hf_endpoint, hf_hub, make_bucket, moto_endpoint, moto_with_iam, storage_env,
)
from vime_engine.runtime.cluster import ray_cluster

CLUSTER_CPUS = 4  # the most any in-process run here places: two trainer ranks and two engines


@pytest.fixture(scope="session")
def _ray_clusters():
    with contextlib.ExitStack() as started:
        yield started


@pytest.fixture(scope="module")
def cluster(request, _ray_clusters):
    """A private local Ray cluster for the modules that train in this process (`train()` and `Workers` join it).

    Starting Ray costs about 10 s here, so one cluster serves module after module: a module that leaves a CPU
    taken (an actor or placement group it did not end) shuts it down, so the next module starts on a clean one,
    and the last module that asks for it shuts it down, so it holds no memory while the rest of the suite runs.
    """
    import ray

    if not ray.is_initialized():
        _ray_clusters.enter_context(ray_cluster(num_cpus=CLUSTER_CPUS))
    yield
    if not (_all_cpus_free(ray) and _a_later_module_asks_for_it(request)):
        ray.shutdown()


def _all_cpus_free(ray, wait_s: float = 10.0) -> bool:
    """Actors end asynchronously: give their CPUs a moment to come back."""
    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _a_later_module_asks_for_it(request) -> bool:
    items = request.session.items
    last = max(i for i, item in enumerate(items) if item.module is request.module)
    return any("cluster" in item.fixturenames for item in items[last + 1:])


@pytest.fixture(scope="session")
def multinode_checks(request) -> dict[str, str]:
    """Test file name -> what its `multinode_check` printed, for every test file of the session that asks: one
    process and one multi-node cluster for all of them (tests.support.multinode)."""
    modules = {item.path: item.module for item in request.session.items if "multinode_checks" in item.fixturenames}
    names = sorted(".".join(path.relative_to(REPO).with_suffix("").parts) for path in modules)
    printed = run_checks_on_a_local_cluster(names, nodes=max(m.NODES for m in modules.values()), timeout=600)
    return {name.rpartition(".")[2]: text for name, text in printed.items()}
