"""Shared for the end-to-end tests: one Prefect server, the deployments with a worker, and one pipeline run
on the tiny model triggered through the REST API (the uninterrupted reference for the resume test too)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.support.prefect_server import PrefectAPI, prefect_api, wait_for_flow_run  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "pipeline-tiny.yaml"


def tiny_parameters(storage_root: str) -> dict:
    """The tiny pipeline's flow parameters as JSON (what the UI form sends)."""
    params = yaml.safe_load(TINY.read_text())
    params["storage"] = {"root": storage_root}
    return params


@dataclass(frozen=True)
class DeployedRun:
    flow_run: dict
    parameters: dict
    storage_root: Path
    deployment_id: str


@pytest.fixture(scope="session")
def deployed(prefect_api: PrefectAPI, tmp_path_factory) -> Iterator[str]:
    """Deployments + automations applied, a process worker running; yields the rl-pipeline deployment id."""
    from flows.deploy import apply_deployments, create_automations, start_worker, stop_processes

    apply_deployments(prefect_api.env)
    create_automations()
    worker = start_worker(prefect_api.env, log_file=prefect_api.home / "worker.log")
    try:
        yield prefect_api.get("/deployments/name/rl-pipeline/rl-pipeline").json()["id"]
    finally:
        stop_processes([worker])  # its process group: the flow runs it started too


@pytest.fixture(scope="session")
def deployed_run(prefect_api: PrefectAPI, deployed: str, tmp_path_factory) -> DeployedRun:
    """rl-pipeline triggered as the UI's "Run" button does (POST create_flow_run), executed by the worker."""
    root = tmp_path_factory.mktemp("storage-e2e")
    params = tiny_parameters(root.as_uri())
    response = prefect_api.post(f"/deployments/{deployed}/create_flow_run", {"parameters": params})
    assert response.status_code == 201, response.text
    run = wait_for_flow_run(prefect_api, response.json()["id"])
    return DeployedRun(run, params, root, deployed)
