"""A real `prefect server` for tests: a free port, its own PREFECT_HOME (SQLite), killed at the end.

`prefect_api` (session-scoped) starts it once; tests talk to it through the REST API exactly as the UI does,
and in-process flow calls reach it through PREFECT_API_URL, which the fixture sets for the session.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.ports import free_port


# Between tries on a 503: about half a minute in all, as Prefect's client allows by default.
RETRY_DELAYS_S = (0.5, 1, 2, 4, 8, 15)


@dataclass(frozen=True)
class PrefectAPI:
    url: str  # http://127.0.0.1:PORT/api
    home: Path
    env: dict[str, str]  # the environment a worker or flow process needs to reach this server

    def get(self, path: str) -> httpx.Response:
        return self._send("GET", path)

    def post(self, path: str, json: dict | None = None) -> httpx.Response:
        return self._send("POST", path, json=json or {})

    def _send(self, method: str, path: str, json: dict | None = None) -> httpx.Response:
        """One request, retried while the server answers 503, as Prefect's own client and the UI do.

        The server sends 503 for errors it calls retryable: with SQLite, a write that meets another
        process's write (SQLITE_BUSY_SNAPSHOT fails at once, whatever the busy timeout). CI met it on a
        loaded machine while the worker and the server's services wrote too.
        """
        for delay in (*RETRY_DELAYS_S, None):  # None: the last try, answered whatever it says
            response = httpx.request(method, f"{self.url}{path}", json=json, timeout=30)
            if response.status_code != 503 or delay is None:
                return response
            time.sleep(delay)


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory) -> Iterator[PrefectAPI]:
    from flows.deploy import start_server, stop_processes

    home = tmp_path_factory.mktemp("prefect-home")
    # Short on purpose: Ray's unix socket paths under its temp dir must stay within 107 bytes, which
    # pytest's /tmp/pytest-of-USER/pytest-NN/... base can exceed.
    ray_tmp = tempfile.mkdtemp(prefix="vfray-", dir="/tmp")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": url,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "INFO",
           "VIMEFLOW_CACHE": str(tmp_path_factory.mktemp("vimeflow-cache")),
           "VIMEFLOW_RAY_TMP": ray_tmp}
    server_env = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    server_env["PREFECT_UI_API_URL"] = url  # the UI's pages call this API (else the default port 4200)
    proc = start_server("127.0.0.1", port, server_env, log_file=home / "server.log")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # child processes and in-process clients of this session talk to this server
    from prefect.settings import PREFECT_API_URL, temporary_settings

    try:
        with temporary_settings({PREFECT_API_URL: url}):  # Prefect may have read its settings already
            yield PrefectAPI(url, home, env)
    finally:
        stop_processes([proc])
        shutil.rmtree(ray_tmp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """Prefect's test harness (a temporary server, about 10 s to start), once per session: in-process flows.

    Prefect's in-process event and log workers keep the server they started with. One started under
    `prefect_api` (an end-to-end test earlier on this xdist worker) went on sending this harness's flows' events
    there: the harness never recorded their task runs (test_staging.py's `task_attempts` found none). Drained at the
    start, they start again on the harness's server."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        EventsWorker.drain_all(at_exit=False)
        APILogWorker.drain_all(at_exit=False)
        yield


def task_attempts(flow_run_id) -> dict[str, int]:
    """How often each task of a flow run (in-process, under prefect_harness) ran, retries included."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0]: run.run_count for run in runs}


def wait_for_flow_run(api: PrefectAPI, flow_run_id: str, timeout: float = 600) -> dict:
    """Poll until the flow run is in a final state; returns its JSON."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = api.get(f"/flow_runs/{flow_run_id}").json()
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(1)
    raise TimeoutError(f"flow run {flow_run_id} not finished after {timeout:.0f} s")


def task_runs_of(api: PrefectAPI, flow_run_id: str) -> list[dict]:
    body = {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200}
    return api.post("/task_runs/filter", body).json()
