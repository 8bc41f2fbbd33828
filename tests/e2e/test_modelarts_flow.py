"""modelarts-training end to end: the deployment run by a worker, each chunk a job on the local ModelArts API
server (tests/support/modelarts_server.py, reached through the real huaweicloudsdkmodelarts client), which runs
the job's command (`vimeflow modelarts-entrypoint`) as local processes with ModelArts' environment; obs://
is the moto server through the real OBS SDK. The training jobs have two nodes of one CPU each, so that the trainer
and the engine run on different nodes of the job's Ray cluster. In the first job the driver waits as rollout 1
begins (a test hook, after rollout 0's checkpoint) until the server has killed the second node's container; the
head ends the job as retryable, a new job resumes from OBS, and the final checkpoint equals the local pipeline
run's bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tasks.modelarts.entrypoint import ClusterEnv, parse_cluster_env
from tests.e2e.conftest import REPO, DeployedRun, tiny_parameters
from tests.support.modelarts_server import ModelArtsServer
from tests.support.prefect_server import PrefectAPI, task_runs_of, wait_for_flow_run
from tests.support.s3_fixtures import TEST_ACCESS_KEY, TEST_SECRET_KEY, moto_endpoint  # noqa: F401

AK, SK, PROJECT = "AKVIMEFLOWE2E0007", "sk-e2e-SeCrEt-0007", "proj-e2e-07"
OBS_ENV = {"OBS_ACCESS_KEY_ID": TEST_ACCESS_KEY, "OBS_SECRET_ACCESS_KEY": TEST_SECRET_KEY,
           "OBS_REGION": "us-east-1", "OBS_PATH_STYLE": "1"}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def modelarts(tmp_path_factory):
    server = ModelArtsServer(tmp_path_factory.mktemp("modelarts"), ak=AK, sk=SK, project_id=PROJECT,
                             creating_s=0.1, pending_s=0.1)
    yield server
    server.close()


@pytest.fixture(scope="module")
def ray_tmp():
    """A short Ray temp dir: Ray's AF_UNIX socket paths under it must stay within 107 bytes, which a
    pytest-of-root/pytest-NN/… directory can exceed."""
    path = tempfile.mkdtemp(prefix="vfr-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def bucket(moto_endpoint):  # noqa: F811
    import boto3

    name = f"vf-ma-{int(time.time())}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", aws_access_key_id=TEST_ACCESS_KEY,
                 aws_secret_access_key=TEST_SECRET_KEY).create_bucket(Bucket=name)
    return name


ENTRYPOINT = f"{sys.executable} -m flows.cli modelarts-entrypoint"
FAULTS = REPO / "tests" / "support" / "faults"


def _submit(api: PrefectAPI, modelarts: ModelArtsServer, moto: str, bucket: str, run_name: str, disk: Path,
            ray_tmp: str, entrypoint: str = ENTRYPOINT, node_count: int = 1,
            job_env: dict[str, str] | None = None) -> tuple[str, dict]:
    """Trigger modelarts-training as the UI does, with the worker's job variables carrying the credentials."""
    params = tiny_parameters(f"obs://{bucket}/{run_name}")  # a root per run: no chunk comes from another's cache
    params.pop("ray_address", None)
    params["storage"]["run_name"] = run_name
    params["modelarts"] = {
        "image": "127.0.0.1:5000/vimeflow/cpu:test", "flavor": "modelarts.vm.cpu.8u", "endpoint": modelarts.url,
        "entrypoint": entrypoint, "working_dir": str(REPO),
        "work_dir": str(disk), "poll_interval_s": 0.3, "max_poll_interval_s": 1.0,
        "forward_env": ["OBS_ENDPOINT", "OBS_REGION", "OBS_PATH_STYLE", "OBS_ACCESS_KEY_ID", "OBS_SECRET_ACCESS_KEY"],
        "node_count": node_count, "env": job_env or {},
    }
    deployment = api.get("/deployments/name/modelarts-training/modelarts-training").json()["id"]
    env = {**OBS_ENV, "OBS_ENDPOINT": moto, "HUAWEICLOUD_SDK_AK": AK, "HUAWEICLOUD_SDK_SK": SK,
           "HUAWEICLOUD_SDK_PROJECT_ID": PROJECT, "VIMEFLOW_RAY_TMP": ray_tmp}
    response = api.post(f"/deployments/{deployment}/create_flow_run",
                        {"parameters": params, "job_variables": {"env": env}})
    assert response.status_code == 201, response.text
    return response.json()["id"], params


def _obs(moto: str, bucket: str):
    from tasks.storage.obs import ObsStorage

    return ObsStorage(bucket, "ma-lost", server=moto, access_key=TEST_ACCESS_KEY, secret_key=TEST_SECRET_KEY,
                      region="us-east-1", path_style=True)


def test_a_job_that_loses_a_node_is_resumed_by_a_new_job_and_ends_equal_to_a_local_run(
        prefect_api: PrefectAPI, deployed: str, deployed_run: DeployedRun, modelarts: ModelArtsServer,
        moto_endpoint, bucket, ray_tmp, tmp_path):  # noqa: F811 (moto_endpoint: the fixture)
    job_env = {
        # Ray's own override of what a node offers: one CPU, one device a node, as a 1-GPU flavor would give.
        "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": 1}),
        # The driver, as rollout 1 begins (rollout 0 checkpointed), waits until a node of its cluster is gone.
        "PYTHONPATH": f"{FAULTS}{os.pathsep}{REPO}", "VIMEFLOW_TEST_FAULT_VICTIM": "node",
        "VIMEFLOW_TEST_FAULT": "vime_engine.rollout.dynamic_sampling:collect_groups:2",
        "VIMEFLOW_TEST_FAULT_MARKER": str(tmp_path / "node-lost.marker"),
    }
    modelarts.lose_node_on_log("VIMEFLOW_TEST_FAULT: waiting for a node to leave", "worker-1")
    t0 = time.monotonic()
    flow_run_id, params = _submit(prefect_api, modelarts, moto_endpoint, bucket, "ma-lost", tmp_path / "disk",
                                  ray_tmp, node_count=2, job_env=job_env)
    run = wait_for_flow_run(prefect_api, flow_run_id, timeout=420)
    print(f"modelarts-training took {time.monotonic() - t0:.1f} s")
    assert run["state"]["type"] == "COMPLETED", run["state"]

    jobs = sorted(modelarts.jobs.values(), key=lambda j: j.create_time)
    for job in jobs:  # the job body the submitter sent: image, flavor, two nodes, the entrypoint on the chunk spec
        algorithm = job.body["algorithm"]
        assert algorithm["engine"]["image_url"] == params["modelarts"]["image"]
        resource = job.body["spec"]["resource"]
        assert (resource["flavor_id"], resource["node_count"]) == ("modelarts.vm.cpu.8u", 2)
        assert "modelarts-entrypoint --spec obs://" in algorithm["command"]
        assert "HUAWEICLOUD_SDK_SK" not in algorithm["environments"]  # API credentials stay with the submitter
    first = [j for j in jobs if j.body["algorithm"]["command"].endswith("/chunk-0000000.json")]
    second = [j for j in jobs if j.body["algorithm"]["command"].endswith("/chunk-0000002.json")]
    assert len(first) + len(second) == len(jobs)
    # A loaded machine may also fail a job with exit 3 (e.g. Ray's OOM killer): retried as a new job as well.
    infra = [j for j in first[:-2] + second[:-1] if j.phase == "Failed" and j.exit_codes[0] == 3]
    assert len(infra) == len(first) - 2 + len(second) - 1
    lost, resumed, last = first[-2], first[-1], second[-1]
    assert (lost.phase, lost.exit_codes) == ("Failed", [3, -9])  # the head saw its node go: retryable
    assert (resumed.phase, last.phase) == ("Completed", "Completed")
    logs = [job.log_path("worker-0").read_text() for job in (lost, resumed, last)]
    for log in logs:  # the trainer and the engine on different nodes of the job's cluster
        assert "on 2 node(s)" in log
        [placed] = re.findall(r"trainer group on node\(s\) (\w+); rollout engines on node\(s\) (\w+)", log)
        assert placed[0] != placed[1], log
    assert "starting from the initial model" in logs[0] and "committed rollout_0000000" in logs[0]
    assert "committed rollout_0000001" not in logs[0] and "engine exit 3" in logs[0]  # the node died mid-chunk
    assert "resuming from committed checkpoint rollout 0" in logs[1]
    assert "committed rollout_0000001" in logs[1] and "committed rollout_0000000" not in logs[1]
    assert "resuming from committed checkpoint rollout 1" in logs[2]

    tasks = {t["name"]: t for t in task_runs_of(prefect_api, flow_run_id)}
    assert tasks["submit_modelarts-from-0"]["run_count"] == len(first)  # one Prefect attempt per job
    assert tasks["submit_modelarts-from-2"]["run_count"] == len(second)

    root = _obs(moto_endpoint, bucket)
    lineage = json.loads(root.get_bytes("runs/ma-lost/published/lineage.json"))
    assert [c["rollouts"] for c in lineage["chunks"]] == [[0, 1], [2, 3]]
    assert [c["resumed_from"] for c in lineage["chunks"]] == [0, 1]
    assert "sk-" not in json.dumps(lineage["parameters"]) and TEST_SECRET_KEY not in json.dumps(lineage)
    final = root.get_bytes("runs/ma-lost/checkpoints/rollout_0000003/model.safetensors")

    # The same parameters run by the local pipeline (local storage, local Ray, never interrupted).
    [reference] = list(deployed_run.storage_root.glob("runs/*/checkpoints/rollout_0000003/model.safetensors"))
    assert _sha256(final) == _sha256(reference.read_bytes())


def _running_sleeper(api: PrefectAPI, modelarts: ModelArtsServer, moto: str, bucket: str, run_name: str,
                     disk: Path, ray_tmp: str):
    """A flow run whose first job sleeps before the entrypoint (surely still running when the test acts)."""
    before = set(modelarts.jobs)
    flow_run_id, _ = _submit(api, modelarts, moto, bucket, run_name, disk, ray_tmp,
                             entrypoint=f"echo started; sleep 300; {ENTRYPOINT}")
    deadline = time.monotonic() + 240
    while not (new := [j for k, j in modelarts.jobs.items() if k not in before and j.phase == "Running"
                       and b"started" in j.log_path("worker-0").read_bytes()]):
        assert time.monotonic() < deadline, "no job started"
        time.sleep(0.2)
    return flow_run_id, new[0]


def test_cancelling_the_flow_run_terminates_the_job(prefect_api: PrefectAPI, deployed: str,
                                                    modelarts: ModelArtsServer, moto_endpoint, bucket,  # noqa: F811
                                                    ray_tmp, tmp_path):
    flow_run_id, job = _running_sleeper(prefect_api, modelarts, moto_endpoint, bucket, "ma-cancel",
                                        tmp_path / "disk", ray_tmp)
    response = prefect_api.post(f"/flow_runs/{flow_run_id}/set_state",
                                {"state": {"type": "CANCELLING", "name": "Cancelling"}})
    assert response.status_code in (200, 201), response.text
    assert modelarts.wait_for_phase(job.id, {"Terminated"}, timeout=120) == "Terminated"
    assert all(p.poll() is not None for p in job.processes)
    run = wait_for_flow_run(prefect_api, flow_run_id, timeout=120)
    assert run["state"]["type"] == "CANCELLED", run["state"]


def test_a_job_terminated_on_modelarts_cancels_the_run(prefect_api: PrefectAPI, deployed: str,
                                                       modelarts: ModelArtsServer, moto_endpoint, bucket,  # noqa: F811
                                                       ray_tmp, tmp_path):
    flow_run_id, job = _running_sleeper(prefect_api, modelarts, moto_endpoint, bucket, "ma-terminated",
                                        tmp_path / "disk", ray_tmp)
    modelarts.stop(job.id)  # what "Stop" in the ModelArts console does
    run = wait_for_flow_run(prefect_api, flow_run_id, timeout=120)
    assert run["state"]["type"] == "CANCELLED", run["state"]
    tasks = {t["name"]: t["state"]["type"] for t in task_runs_of(prefect_api, flow_run_id)}
    assert tasks["submit_modelarts-from-0"] == "CANCELLED" and "submit_modelarts-from-2" not in tasks, tasks


# ---------------------------------------------------------------- the contract's pure parts


def test_cluster_env_from_modelarts_variables():
    two = {"VC_TASK_INDEX": "1", "VC_WORKER_HOSTS": "10.0.0.5,10.0.0.6", "MA_NUM_HOSTS": "2"}
    assert parse_cluster_env(two) == ClusterEnv(1, ["10.0.0.5", "10.0.0.6"])
    assert parse_cluster_env(two).head_address == "10.0.0.5:6379" and not parse_cluster_env(two).is_head
    assert parse_cluster_env({"MA_CURRENT_IP": "10.0.0.9"}) == ClusterEnv(0, ["10.0.0.9"])
    with pytest.raises(ValueError, match="VC_WORKER_HOSTS is not set"):
        parse_cluster_env({"MA_NUM_HOSTS": "2"})
    with pytest.raises(ValueError, match="MA_NUM_HOSTS=3"):
        parse_cluster_env({**two, "MA_NUM_HOSTS": "3"})
