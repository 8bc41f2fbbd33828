"""`vimeflow server`: bound to loopback unless the API demands basic auth, and SIGTERM or SIGINT stops every
process it started (the Prefect server, the worker), whether it is serving or still starting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from flows.deploy import STOP_GRACE_S
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
AUTH = "vimeflow:test-only-Hq3v8"


def _start(tmp_path: Path, port: int, auth: str | None = None) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    if auth:
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "server", "--port", str(port)], cwd=REPO, env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def _wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"vimeflow server exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _stop_and_check(proc: subprocess.Popen, log: Path, signum: int, started: list[psutil.Process]) -> None:
    proc.send_signal(signum)
    try:
        code = proc.wait(timeout=STOP_GRACE_S + 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, log.read_text()[-3000:]
    assert f"{signal.Signals(signum).name}: the Prefect server and worker are stopped" in log.read_text()
    left = [p for p in started if p.is_running()]  # is_running also compares start times: no reused pids
    assert not left, f"left running: {[' '.join(p.cmdline()) for p in left]}"


def _commands(procs: list[psutil.Process]) -> str:
    return "\n".join(" ".join(p.cmdline()) for p in procs if p.is_running())


def test_sigterm_stops_the_server_and_its_worker_and_the_api_demands_the_auth_string(tmp_path):
    port = free_port()
    proc, log = _start(tmp_path, port, auth=AUTH)
    try:
        _wait_for(lambda: "Prefect UI:" in log.read_text(), proc, log, 240, "ready line")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert "prefect server start" in _commands(children) and "prefect worker start" in _commands(children)

        api = f"http://127.0.0.1:{port}/api"
        assert httpx.post(f"{api}/flows/filter", json={}).status_code == 401
        # The deployments exist: the clients `vimeflow server` ran were given the auth string.
        deployment = httpx.get(f"{api}/deployments/name/rl-pipeline/rl-pipeline", auth=tuple(AUTH.split(":")))
        assert deployment.status_code == 200, deployment.text
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    _stop_and_check(proc, log, signal.SIGTERM, children)


def test_sigint_while_the_server_starts_stops_it_too(tmp_path):
    port = free_port()
    proc, log = _start(tmp_path, port)
    children: list[psutil.Process] = []

    def server_started() -> bool:
        children[:] = psutil.Process(proc.pid).children(recursive=True)
        return "prefect server start" in _commands(children)

    try:
        _wait_for(server_started, proc, log, 60, "prefect server child")
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    _stop_and_check(proc, log, signal.SIGINT, children)


def test_a_host_beyond_loopback_is_refused_without_auth(monkeypatch):
    from typer.testing import CliRunner

    from flows.cli import app

    monkeypatch.delenv("PREFECT_SERVER_API_AUTH_STRING", raising=False)
    port = free_port()
    result = CliRunner().invoke(app, ["server", "--host", "0.0.0.0", "--port", str(port)])
    assert result.exit_code == 2
    assert "refusing to serve the Prefect API on 0.0.0.0" in result.output
    assert "PREFECT_SERVER_API_AUTH_STRING" in result.output
    with pytest.raises(httpx.ConnectError):  # nothing was started
        httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2)


def test_a_server_that_cannot_start_ends_the_command_naming_its_log(tmp_path):
    import socket

    with socket.socket() as taken:  # the port is in use (not by an HTTP server)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc, log = _start(tmp_path, taken.getsockname()[1])
        try:
            code = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert code == 1
    server_log = tmp_path / "prefect-home" / "vimeflow-server.log"
    assert f"error: prefect server exited with code 1: see {server_log}" in log.read_text()
    assert "is already in use" in server_log.read_text()
