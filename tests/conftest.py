"""Fixtures shared across the suite: the built-in tiny model and datasets, made once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vime_engine.data.synthetic import materialize_builtin_dataset
from vime_engine.models.builtin import materialize_builtin_model


@pytest.fixture(scope="session")
def assets_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("assets")


@pytest.fixture(scope="session")
def tiny_model(assets_dir) -> Path:
    return materialize_builtin_model("tiny-qwen3", assets_dir / "tiny-qwen3")


@pytest.fixture(scope="session")
def arithmetic_data(assets_dir) -> Path:
    return materialize_builtin_dataset("arithmetic", assets_dir / "datasets")


@pytest.fixture(scope="session")
def aime_data(assets_dir) -> Path:
    return materialize_builtin_dataset("aime-synthetic", assets_dir / "datasets")


# `VIMEFLOW_TEST_WORKERS=N scripts/test` runs the suite on N pytest-xdist workers (2 by default, as CI runs it: see the
# README). Tests that share a module- or session-scoped run must land on one worker, or each worker makes that run
# again: a module's tests go together, and so do the end-to-end modules (one Prefect server, its deployments and
# one pipeline run) and the multi-node modules (one multi-node cluster, tests/support/multinode.py). The heaviest
# groups go first, so that the last group to start is a short one and the workers finish together.
HEAVIEST_FIRST = ("tests/e2e/", "tests/component/test_resume.py")


def worker_group(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    if path.startswith("tests/e2e/"):
        return "tests/e2e"
    if path.endswith("_multinode.py"):
        return "multinode"
    return path


@pytest.hookimpl(optionalhook=True)  # the Megatron lane has no xdist
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerGroup(LoadScopeScheduling):
        """Scopes in collection order (see pytest_collection_modifyitems), one per `worker_group`."""

        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByWorkerGroup(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: the collection's order

    def rank(item: pytest.Item) -> int:
        return next((i for i, prefix in enumerate(HEAVIEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(HEAVIEST_FIRST))

    items.sort(key=rank)  # stable: collection order within a rank
