"""ModelArts credentials from a Prefect Secret block, end to end: saved to Prefect's API, loaded inside a task
run by the client submit_modelarts uses, signing the real huaweicloudsdkmodelarts requests that
tests/support/modelarts_server.py verifies; the keys never in the run's logs, its task parameters or an error."""

from __future__ import annotations

import json
import uuid

import pytest

from tasks.modelarts.client import (
    ENV_AK, ENV_PROJECT_ID, ENV_SK, JobOutcome, ModelArtsError, ModelArtsJobSpec, run_modelarts_job,
)
from tasks.submit_modelarts import ModelArtsSettings, modelarts_client
from tests.support.modelarts_server import ModelArtsServer

AK, SK, PROJECT = "AKVIMEFLOWBLOCK0017", "sk-block-SeCrEt-0017-q", "proj-blk-17"


@pytest.fixture
def server(tmp_path):
    srv = ModelArtsServer(tmp_path / "modelarts", ak=AK, sk=SK, project_id=PROJECT, creating_s=0.05, pending_s=0.05)
    yield srv
    srv.close()


@pytest.fixture
def no_environment_credentials(monkeypatch):
    for name in (ENV_AK, ENV_SK, ENV_PROJECT_ID):
        monkeypatch.delenv(name, raising=False)


def _secret_block(value) -> str:
    from prefect.blocks.system import Secret

    name = f"vimeflow-modelarts-{uuid.uuid4().hex[:8]}"
    Secret(value=value).save(name)
    return name


def _submit_in_a_flow(server: ModelArtsServer, block: str):
    """A flow whose task submits a one-line job with the settings' client, as submit_modelarts does."""
    from prefect import flow, get_run_logger, task

    settings = ModelArtsSettings(image="swr.example/vimeflow/cpu:1", flavor="modelarts.vm.cpu.8u",
                                 endpoint=server.url, credentials_block=block)
    job = ModelArtsJobSpec(name="vf-credentials-0", image=settings.image, command="echo job ran",
                           flavor=settings.flavor)

    @task
    def submit(settings: ModelArtsSettings) -> str:
        result = run_modelarts_job(job, modelarts_client(settings), logger=get_run_logger(), interval=0.02,
                                   max_interval=0.1)
        return result.outcome.value

    @flow
    def submit_one(settings: ModelArtsSettings) -> str:
        return submit(settings)

    return submit_one(settings, return_state=True)


def _run_text(flow_run_id) -> str:
    """Everything Prefect recorded of the run: its logs and its task runs' parameters and states."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # logs go to the API in the background
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        flow_run = client.read_flow_run(flow_run_id)
    return json.dumps([log.message for log in logs] + [t.model_dump(mode="json") for t in tasks]
                      + [flow_run.model_dump(mode="json")])


@pytest.mark.parametrize("stored_as", ["json text", "dict"])
def test_a_job_runs_with_the_credentials_of_a_secret_block(stored_as, prefect_harness, server,
                                                            no_environment_credentials):
    keys = {"ak": AK, "sk": SK, "project_id": PROJECT}
    block = _secret_block(json.dumps(keys) if stored_as == "json text" else keys)
    state = _submit_in_a_flow(server, block)
    assert state.result() == JobOutcome.COMPLETED.value
    assert [job.phase for job in server.jobs.values()] == ["Completed"]
    recorded = _run_text(state.state_details.flow_run_id)
    assert "job ran" in recorded  # the job's log reached the run's log
    assert AK not in recorded and SK not in recorded


@pytest.mark.parametrize("case", ["wrong secret key", "missing project", "no such block"])
def test_a_bad_secret_block_fails_with_a_clear_message_and_no_keys(case, prefect_harness, server,
                                                                    no_environment_credentials):
    wrong_sk = "sk-wrong-but-still-secret-17"
    if case == "wrong secret key":
        block, expected = _secret_block({"ak": AK, "sk": wrong_sk, "project_id": PROJECT}), "verify aksk signature"
    elif case == "missing project":
        block = _secret_block({"ak": AK, "sk": SK})
        expected = f"Secret block {block!r} lacks ['project_id']"
    else:
        block, expected = "vimeflow-no-such-block", "no Secret block named 'vimeflow-no-such-block': save one"
    state = _submit_in_a_flow(server, block)
    with pytest.raises(ModelArtsError) as failure:
        state.result()
    assert expected in str(failure.value)
    assert not server.jobs  # nothing was created
    recorded = _run_text(state.state_details.flow_run_id) + str(failure.value)
    for key in (AK, SK, wrong_sk):
        assert key not in recorded
