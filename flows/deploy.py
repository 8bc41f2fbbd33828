"""Serving the pipeline: a Prefect server, a process worker, the deployments and the crash automations.

`vimeflow server` = start_server + apply (work pool, deployments, automations) + start_worker;
`vimeflow deploy` = apply against whatever server PREFECT_API_URL points at.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFECT_YAML = REPO_ROOT / "deployments" / "prefect.yaml"
WORK_POOL = "vimeflow-process"
HEARTBEAT_TIMEOUT = timedelta(seconds=90)  # three missed heartbeats at PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30
ZOMBIE_AUTOMATION = "vimeflow: mark flow runs without heartbeats crashed"
RERUN_AUTOMATION = "vimeflow: re-run crashed rl-pipeline runs"
CRASH_RERUN_LIMIT = 3  # re-runs of one flow run; a run that crashes more often has no passing cause


def _prefect(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO_ROOT, env=env or dict(os.environ),
                          check=True, **kwargs)


def start_server(host: str = "127.0.0.1", port: int = 4200, env: dict[str, str] | None = None,
                 log_file: Path | None = None) -> subprocess.Popen:
    """`prefect server start` (SQLite under PREFECT_HOME unless PREFECT_API_DATABASE_CONNECTION_URL says
    otherwise); returns once /api/health answers."""
    env = dict(env or os.environ)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port",
                             str(port)], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    wait_healthy(f"http://{host}:{port}/api", proc)
    return proc


def wait_healthy(api_url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no healthy Prefect API at {api_url} after {timeout:.0f} s")


def start_worker(env: dict[str, str] | None = None, log_file: Path | None = None) -> subprocess.Popen:
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", WORK_POOL,
                             "--type", "process"], env=dict(env or os.environ), cwd=REPO_ROOT, stdout=out,
                            stderr=subprocess.STDOUT)


def apply_deployments(env: dict[str, str] | None = None) -> None:
    """Create the work pool if missing, then `prefect deploy --all` from deployments/prefect.yaml."""
    env = {**(env or os.environ), "VIMEFLOW_REPO": str(REPO_ROOT)}
    listed = _prefect("work-pool", "ls", env=env, capture_output=True, text=True).stdout
    if WORK_POOL not in listed:
        _prefect("work-pool", "create", WORK_POOL, "--type", "process", env=env, capture_output=True)
    _prefect("--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_YAML), env=env, capture_output=True)


def create_automations() -> list[str]:
    """(1) a flow run whose heartbeats stop is marked Crashed; (2) a crashed rl-pipeline run is scheduled
    again (same flow run, same parameters: its finished chunks come back from the cache), at most
    CRASH_RERUN_LIMIT times: the flow itself refuses to start once more (`refuse_endless_reruns`)."""
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("rl-pipeline/rl-pipeline")
        for existing in client.read_automations_by_name(ZOMBIE_AUTOMATION) + client.read_automations_by_name(
                RERUN_AUTOMATION):
            client.delete_automation(existing.id)
    zombie = Automation(
        name=ZOMBIE_AUTOMATION,
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match={"prefect.resource.id": ["prefect.flow-run.*"]},
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1, within=HEARTBEAT_TIMEOUT,
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {HEARTBEAT_TIMEOUT.seconds} s: its machine vanished")],
    ).create()
    rerun = Automation(
        name=RERUN_AUTOMATION,
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match={"prefect.resource.id": ["prefect.flow-run.*"]},
            match_related={"prefect.resource.id": [f"prefect.deployment.{deployment.id}"]},
            for_each={"prefect.resource.id"}, posture=Posture.Reactive, threshold=1,
        ),
        actions=[ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRetry", force=True,
                                    message="re-run after a crash; finished chunks come back from the cache")],
    ).create()
    return [str(zombie.id), str(rerun.id)]


def refuse_endless_reruns(run_count: int, limit: int = CRASH_RERUN_LIMIT) -> None:
    """Called first in a flow run the crash automation may re-run: its run count says how often it started."""
    if run_count > limit + 1:
        raise RuntimeError(
            f"this flow run has started {run_count} times (re-run after crashes, limit {limit}): something "
            "kills it every time, so it is not a passing fault. Read the logs of the earlier attempts, fix the "
            "cause and start a new run (finished chunks come back from the cache)"
        )


def ui_url(api_url: str) -> str:
    return api_url.removesuffix("/").removesuffix("/api")
