"""ModelArts training jobs through the real huaweicloudsdkmodelarts client against
tests/support/modelarts_server.py, which checks the SDK's AK/SK signature and runs each job's command
as local processes with ModelArts' container environment."""

from __future__ import annotations

import logging
import sys

import pytest

from tasks.modelarts.client import (
    ENV_AK,
    ENV_PROJECT_ID,
    ENV_SK,
    JobOutcome,
    ModelArtsCredentials,
    ModelArtsError,
    ModelArtsJobSpec,
    ObsMount,
    load_credentials,
    make_client,
    outcome_for,
    poll_until_done,
    run_modelarts_job,
    show_job,
    stop_job,
    submit_modelarts_job,
)
from tasks.modelarts.logs import LogTail
from tests.support.modelarts_server import ModelArtsServer

AK, SK, PROJECT = "AKVIMEFLOWTEST0042", "sk-VeRy-SeCrEt-0042-xyz", "proj-0a1b2c"
FAST = {"interval": 0.02, "max_interval": 0.1}
PY = sys.executable


def py(code: str) -> str:
    """A shell command running ``code`` with this interpreter (the job command is run by /bin/sh)."""
    return f"{PY} -u -c '{code}'"


@pytest.fixture
def server(tmp_path):
    srv = ModelArtsServer(tmp_path / "modelarts", ak=AK, sk=SK, project_id=PROJECT, creating_s=0.1, pending_s=0.1)
    yield srv
    srv.close()


@pytest.fixture
def client(server):
    return make_client(ModelArtsCredentials(ak=AK, sk=SK, project_id=PROJECT), endpoint=server.url)


@pytest.fixture
def joblog():
    logger = logging.getLogger("test.modelarts.job")
    logger.setLevel(logging.INFO)
    return logger


def spec(command: str, **kw) -> ModelArtsJobSpec:
    base = dict(name="vimeflow-chunk-0", image="swr.cn-north-4.myhuaweicloud.com/vimeflow/npu:0.1.0",
                command=command, flavor="modelarts.pool.visual.xlarge", pool_id="pool-7f3a",
                inputs=[ObsMount(name="model", obs_url="obs://bkt/runs/r1/model", local_dir="/cache/model")],
                outputs=[ObsMount(name="ckpt", obs_url="obs://bkt/runs/r1/ckpt/", local_dir="/cache/ckpt")],
                env={"VIMEFLOW_RUN": "r1"}, log_obs_url="obs://bkt/runs/r1/logs")
    return ModelArtsJobSpec(**{**base, **kw})


def lines_of(caplog, task: str) -> list[str]:
    return [r.getMessage()[len(task) + 3:] for r in caplog.records if r.getMessage().startswith(f"[{task}] ")]


# ---------------------------------------------------------------- submit, phases, logs


def test_submit_sends_the_v2_job_body(server, client):
    job_id = submit_modelarts_job(spec("true", node_count=2), client)
    body = server.jobs[job_id].body
    assert body["kind"] == "job" and body["metadata"]["name"] == "vimeflow-chunk-0"
    assert body["algorithm"]["engine"]["image_url"] == "swr.cn-north-4.myhuaweicloud.com/vimeflow/npu:0.1.0"
    assert body["algorithm"]["command"] == "true"
    assert body["algorithm"]["inputs"] == [{"name": "model", "local_dir": "/cache/model",
                                            "remote": {"obs": {"obs_url": "/bkt/runs/r1/model/"}}}]
    assert body["algorithm"]["outputs"][0]["remote"]["obs"]["obs_url"] == "/bkt/runs/r1/ckpt/"
    assert body["algorithm"]["environments"] == {"VIMEFLOW_RUN": "r1"}
    assert body["spec"]["resource"] == {"flavor_id": "modelarts.pool.visual.xlarge", "node_count": 2,
                                        "pool_id": "pool-7f3a"}
    assert body["spec"]["log_export_path"] == {"obs_url": "/bkt/runs/r1/logs/"}
    assert show_job(client, job_id).metadata.name == "vimeflow-chunk-0"


def test_job_completes_with_phases_in_order_and_modelarts_environment(server, client, joblog, caplog):
    code = ('import os\n'
            'for k in ("VC_TASK_INDEX","VC_WORKER_NUM","VC_WORKER_HOSTS","MA_NUM_HOSTS","MA_TASK_NAME","VIMEFLOW_RUN"):'
            ' print(k + "=" + os.environ[k])')
    with caplog.at_level(logging.INFO):
        result = run_modelarts_job(spec(py(code), node_count=2), client, logger=joblog, **FAST)
    assert result.outcome is JobOutcome.COMPLETED and not result.outcome.retryable
    assert result.phase == "Completed" and result.duration_ms is not None
    phases = [r.getMessage().split("phase ", 1)[1] for r in caplog.records if ": phase " in r.getMessage()]
    assert phases == ["Creating", "Pending (Queuing)", "Running", "Completed"]
    for index in (0, 1):
        assert lines_of(caplog, f"worker-{index}") == [
            f"VC_TASK_INDEX={index}", "VC_WORKER_NUM=2", "VC_WORKER_HOSTS=127.0.0.1,127.0.0.1", "MA_NUM_HOSTS=2",
            "MA_TASK_NAME=worker", "VIMEFLOW_RUN=r1"]


def test_log_lines_stream_while_running_each_exactly_once(server, client, joblog, caplog):
    code = 'import time\nfor i in range(40):\n    print(f"step {i:03d}", flush=True); time.sleep(0.01)'
    with caplog.at_level(logging.INFO):
        result = run_modelarts_job(spec(py(code)), client, logger=joblog, **FAST)
    assert result.outcome is JobOutcome.COMPLETED
    assert lines_of(caplog, "worker-0") == [f"step {i:03d}" for i in range(40)]
    previews = [p for m, p in server.requests if p.endswith("/logs/preview")]
    assert len(previews) > 3  # the log was read many times while it grew, yet no line repeated


def test_small_preview_window_skips_with_a_marker_never_repeats(tmp_path, joblog, caplog):
    srv = ModelArtsServer(tmp_path / "ma", ak=AK, sk=SK, project_id=PROJECT, creating_s=0.05, pending_s=0.05,
                          preview_limit=32)
    try:
        client = make_client(ModelArtsCredentials(ak=AK, sk=SK, project_id=PROJECT), endpoint=srv.url)
        code = 'for i in range(200): print(f"line {i:04d}")'
        with caplog.at_level(logging.INFO):
            result = run_modelarts_job(spec(py(code)), client, logger=joblog, interval=0.3, max_interval=0.3)
    finally:
        srv.close()
    assert result.outcome is JobOutcome.COMPLETED
    got = lines_of(caplog, "worker-0")
    shown = [line for line in got if line.startswith("line ")]
    assert shown == sorted(set(shown)) and shown[-1] == "line 0199"
    assert any("bytes of log not shown" in line for line in got)


def test_failed_command_maps_to_failed(server, client, joblog):
    result = run_modelarts_job(spec(py('import sys; print("bad config"); sys.exit(3)')), client, logger=joblog, **FAST)
    assert result.outcome is JobOutcome.FAILED and not result.outcome.retryable
    assert server.jobs[result.job_id].exit_codes == [3]


def test_job_killed_mid_way_is_abnormal_and_crashed(server, client, joblog, caplog):
    server.crash_on_log("step 2")
    code = 'import time\nfor i in range(100):\n    print(f"step {i}", flush=True); time.sleep(0.05)'
    with caplog.at_level(logging.INFO):
        result = run_modelarts_job(spec(py(code)), client, logger=joblog, **FAST)
    assert (result.outcome, result.phase, result.secondary_phase) == (JobOutcome.CRASHED, "Abnormal", "Lost")
    assert result.outcome.retryable
    lines = lines_of(caplog, "worker-0")
    assert "step 2" in lines and "step 99" not in lines


def test_stop_terminates_and_maps_to_cancelled(server, client, joblog):
    job_id = submit_modelarts_job(spec(py('import time; print("started", flush=True); time.sleep(60)')), client)
    server.wait_for_phase(job_id, {"Running"})
    stop_job(client, job_id)
    result = poll_until_done(client, job_id, logger=joblog, **FAST)
    assert (result.outcome, result.phase) == (JobOutcome.CANCELLED, "Terminated")
    assert all(p.poll() is not None for p in server.jobs[job_id].processes)


def test_interrupted_follower_terminates_the_job(server, client, joblog):
    calls = []

    def interrupting_sleep(seconds: float) -> None:
        calls.append(seconds)
        if len(calls) == 8:  # well into Running: the Prefect run was cancelled
            raise KeyboardInterrupt
        import time
        time.sleep(seconds)

    with pytest.raises(KeyboardInterrupt):
        run_modelarts_job(spec(py('import time; time.sleep(60)')), client, logger=joblog, sleep=interrupting_sleep,
                          **FAST)
    (job_id,) = server.jobs
    assert server.wait_for_phase(job_id, {"Terminated"}) == "Terminated"


def test_transient_errors_are_retried_and_waits_back_off(server, client, joblog):
    waits = []

    def recording_sleep(seconds: float) -> None:
        waits.append(seconds)
        import time
        time.sleep(seconds)

    job_id = submit_modelarts_job(spec(py('import time; time.sleep(0.8)')), client)
    server.fail_next = 2
    result = poll_until_done(client, job_id, logger=joblog, interval=0.01, max_interval=0.08, backoff=2.0,
                             sleep=recording_sleep)
    assert result.outcome is JobOutcome.COMPLETED
    assert max(waits) == 0.08 and min(waits) == 0.01
    assert any(b == a * 2 for a, b in zip(waits, waits[1:]))  # growing while nothing changes


def test_list_events_and_delete_through_the_sdk(server, client, joblog):
    from huaweicloudsdkmodelarts.v1 import (DeleteTrainingJobRequest, JobSearches, ListTrainingJobEventsRequest,
                                            ListTrainingJobsRequest)

    result = run_modelarts_job(spec("true"), client, logger=joblog, **FAST)
    listed = client.list_training_jobs(ListTrainingJobsRequest(body=JobSearches()))
    assert [item.metadata.id for item in listed.items] == [result.job_id]
    events = client.list_training_job_events(ListTrainingJobEventsRequest(training_job_id=result.job_id)).events
    assert [e.message for e in events][-1] == "Training job phase changed to Completed"
    client.delete_training_job(DeleteTrainingJobRequest(training_job_id=result.job_id))
    with pytest.raises(ModelArtsError) as err:
        show_job(client, result.job_id)
    assert (err.value.status, err.value.code) == (404, "ModelArts.2628") and "does not exist" in str(err.value)


# ---------------------------------------------------------------- errors and secrets


def test_bad_credentials_give_a_clear_error_without_secrets(server, caplog):
    wrong_sk = "sk-wrong-but-still-secret-99"
    bad = make_client(ModelArtsCredentials(ak=AK, sk=wrong_sk, project_id=PROJECT), endpoint=server.url)
    with caplog.at_level(logging.DEBUG), pytest.raises(ModelArtsError) as err:
        submit_modelarts_job(spec("true"), bad)
    message = str(err.value)
    assert (err.value.status, err.value.code) == (401, "APIGW.0301")
    assert "create training job" in message and "verify aksk signature fail" in message
    for secret in (wrong_sk, AK):
        assert secret not in message and secret not in repr(err.value) and secret not in caplog.text


def test_error_body_from_the_service_is_surfaced(server, client):
    with pytest.raises(ModelArtsError) as err:
        submit_modelarts_job(spec("   "), client)
    assert (err.value.status, err.value.code) == (400, "ModelArts.2702") and "empty command" in err.value.message


def test_secrets_never_reach_logs_or_reprs(server, client, joblog, caplog, monkeypatch):
    monkeypatch.setenv(ENV_AK, AK)
    monkeypatch.setenv(ENV_SK, SK)
    monkeypatch.setenv(ENV_PROJECT_ID, PROJECT)
    creds = load_credentials()
    with caplog.at_level(logging.DEBUG):
        env_client = make_client(creds, endpoint=server.url)
        result = run_modelarts_job(spec(py('import os; print(sorted(os.environ))')), env_client, logger=joblog, **FAST)
        with pytest.raises(ModelArtsError) as err:
            show_job(env_client, "no-such-job")
    assert result.outcome is JobOutcome.COMPLETED
    printed = " ".join(lines_of(caplog, "worker-0"))
    assert ENV_SK not in printed  # the job's container does not inherit the submitter's credentials
    for text in (caplog.text, repr(creds), str(creds), str(err.value), repr(spec("true"))):
        assert AK not in text and SK not in text


def test_missing_credentials_name_the_variables(monkeypatch):
    for name in (ENV_AK, ENV_SK, ENV_PROJECT_ID):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ENV_SK, SK)
    with pytest.raises(ModelArtsError) as err:
        load_credentials()
    assert ENV_AK in str(err.value) and ENV_PROJECT_ID in str(err.value) and SK not in str(err.value)


def test_spec_rejects_reserved_env_and_bad_obs_urls():
    with pytest.raises(ValueError, match="reserved by ModelArts"):
        spec("true", env={"MA_NUM_HOSTS": "4"})
    with pytest.raises(ValueError):
        ObsMount(name="model", obs_url="s3://bkt/x", local_dir="/cache")


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize("phase, secondary, outcome", [
    ("Creating", "Creating", None), ("Pending", "Queuing", None), ("Running", "Running", None),
    ("Terminating", "Terminating", None), ("Completed", "Completed", JobOutcome.COMPLETED),
    ("Failed", "Failed", JobOutcome.FAILED), ("Failed", "CreateFailed", JobOutcome.FAILED),
    ("Abnormal", "Abnormal", JobOutcome.CRASHED), ("Running", "Lost", JobOutcome.CRASHED),
    ("Running", "Unknown", JobOutcome.CRASHED), ("Unknown", None, JobOutcome.CRASHED),
    ("Terminated", "Terminated", JobOutcome.CANCELLED),
])
def test_phase_to_outcome(phase, secondary, outcome):
    assert outcome_for(phase, secondary) is outcome


def test_log_tail_hand_worked_windows():
    # the log "a\nbb\nccc\nd" (10 bytes) seen through four previews
    tail = LogTail()
    assert tail.feed("a\nb", 3, 3) == ["a"]                  # "b" waits for its newline
    assert tail.feed("a\nbb\ncc", 7, 7) == ["bb"]            # overlap with the last preview skipped
    assert tail.feed("a\nbb\ncc", 7, 7) == []                # nothing new
    assert tail.feed("cc\nd", 4, 10, final=True) == ["ccc", "d"]  # a tail window; the end flushes "d"


def test_log_tail_gap_and_multibyte():
    tail = LogTail()
    assert tail.feed("x\ny", 3, 3) == ["x"]
    # 100 bytes later, only the last 6 are shown: the held "y" is flushed, then the gap is named
    assert tail.feed("é1\nz\n", 6, 103) == ["y", "[... 94 bytes of log not shown: the preview only keeps the tail ...]",
                                             "é1", "z"]
