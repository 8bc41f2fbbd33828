"""Serving the pipeline: a Prefect server, a process worker, the deployments and the crash automations.

`vimeflow server` = serve: start_server + apply (work pool, deployments, automations) + start_worker, until
SIGTERM / SIGINT stops all of it; `vimeflow deploy` = apply against whatever server PREFECT_API_URL points at.

Locked down by default: the server binds 127.0.0.1, and another address is refused unless the API asks for
basic auth (PREFECT_SERVER_API_AUTH_STRING): a Prefect API runs whatever code its deployments name, so an
open one on the network is remote code execution for anyone who reaches it.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
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
SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"  # user:password the server demands (basic auth)
CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"  # what clients send
STOP_GRACE_S = 15.0  # SIGTERM, then this long to finish, then SIGKILL


class ExposedServerError(ValueError):
    """A server on a non-loopback address without authentication."""


class ServerProcessExited(RuntimeError):
    """The Prefect server or the worker ended by itself."""


class ServerStopped(Exception):
    """SIGTERM or SIGINT arrived: stop what was started."""

    def __init__(self, signum: int):
        self.signal_name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.signal_name}")


def _prefect(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO_ROOT, env=env or dict(os.environ),
                          check=True, **kwargs)


def start_server(host: str = "127.0.0.1", port: int = 4200, env: dict[str, str] | None = None,
                 log_file: Path | None = None) -> subprocess.Popen:
    """`prefect server start` (SQLite under PREFECT_HOME unless PREFECT_API_DATABASE_CONNECTION_URL says
    otherwise) in its own process group; returns once /api/health answers, and leaves nothing behind when
    it does not (or when a signal interrupts the wait)."""
    env = dict(env or os.environ)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port",
                             str(port)], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                            start_new_session=True)
    try:
        wait_healthy(api_url(host, port), proc)
    except BaseException as exc:
        stop_processes([proc])
        if isinstance(exc, ServerProcessExited) and log_file:
            raise ServerProcessExited(f"{exc}: see {log_file}") from None
        raise
    return proc


def api_url(host: str, port: int) -> str:
    """The URL local clients use: a wildcard bind address is reached through loopback."""
    reach = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)
    return f"http://{reach}:{port}/api"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_exposure(host: str, env: dict[str, str]) -> None:
    """Refuse to serve the API beyond this machine without basic auth."""
    if _is_loopback(host) or env.get(SERVER_AUTH_ENV):
        return
    raise ExposedServerError(
        f"refusing to serve the Prefect API on {host} without authentication: anyone who reaches it can run "
        f"code through its deployments. Set {SERVER_AUTH_ENV}=USER:PASSWORD (clients then need "
        f"{CLIENT_AUTH_ENV} set to the same), or keep the default --host 127.0.0.1")


def stop_processes(procs: Iterable[subprocess.Popen | None], grace: float = STOP_GRACE_S) -> None:
    """Stop children started in their own process groups: SIGTERM to each group (in the order given), up to
    `grace` seconds for all of them to exit, then SIGKILL to every group, which also takes members a leader
    left behind. Returns once each leader is reaped."""
    procs = [p for p in procs if p is not None]
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # the child leads its group: start_new_session=True
    except ProcessLookupError:
        pass


def _raise_stopped(signum: int, frame) -> None:
    for s in (signal.SIGTERM, signal.SIGINT):  # one stop at a time: a second signal waits for the first
        signal.signal(s, signal.SIG_IGN)
    raise ServerStopped(signum)


def serve(host: str, port: int, on_ready: Callable[[str], None], grace: float = STOP_GRACE_S) -> str:
    """`vimeflow server`: the Prefect server, the deployments and automations, and a process worker, until
    SIGTERM or SIGINT (returns which) or until one of the two exits (raises ServerProcessExited). Whatever way
    it ends, both process groups are stopped before this returns. Their output goes to
    $PREFECT_HOME/vimeflow-server.log and vimeflow-worker.log."""
    check_exposure(host, dict(os.environ))
    logs = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect")).expanduser()
    logs.mkdir(parents=True, exist_ok=True)
    api = api_url(host, port)
    os.environ["PREFECT_API_URL"] = api  # the in-process client of create_automations
    if os.environ.get(SERVER_AUTH_ENV):
        os.environ.setdefault(CLIENT_AUTH_ENV, os.environ[SERVER_AUTH_ENV])
    env = dict(os.environ)
    server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    previous = {s: signal.signal(s, _raise_stopped) for s in (signal.SIGTERM, signal.SIGINT)}
    children: list[subprocess.Popen] = []
    try:
        children.append(start_server(host, port, server_env, log_file=logs / "vimeflow-server.log"))
        apply_deployments(env)
        create_automations()
        children.append(start_worker(env, log_file=logs / "vimeflow-worker.log"))
        on_ready(ui_url(api))
        while all(p.poll() is None for p in children):
            time.sleep(0.5)
        ended, log = next((p, log) for p, log in zip(children, ("server", "worker")) if p.poll() is not None)
        raise ServerProcessExited(f"the Prefect {log} exited with code {ended.returncode}: see "
                                  f"{logs / f'vimeflow-{log}.log'}")
    except ServerStopped as stop:
        return stop.signal_name
    finally:
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        stop_processes(reversed(children), grace)  # the worker first, while the server still answers it
        for s, handler in previous.items():
            signal.signal(s, handler)


def wait_healthy(api_url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerProcessExited(f"prefect server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no healthy Prefect API at {api_url} after {timeout:.0f} s")


def start_worker(env: dict[str, str] | None = None, log_file: Path | None = None) -> subprocess.Popen:
    """A process worker on WORK_POOL, in its own process group (its flow runs join that group)."""
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", WORK_POOL,
                             "--type", "process"], env=dict(env or os.environ), cwd=REPO_ROOT, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


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
