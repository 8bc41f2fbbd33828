"""Where a server's output goes (vime_engine/rollout/server/vllm_server.py): a file of its own among the run's logs,
never overwriting an earlier one (a replaced engine's log is the evidence of its death); outside a run a temporary
file, gone after a clean stop and kept, named in the error, when the server failed. Real processes: Python's own
HTTP server stands in for a server, a script that exits for one that fails to start."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from vime_engine.rollout.server.vllm_server import ServerProcess, free_port, new_log


def test_each_server_start_gets_a_log_of_its_own_in_the_run_log_dir(tmp_path):
    logs = tmp_path / "out" / "logs"  # made on first use
    first = new_log(logs, "vllm-server-0")
    first.write_text("the dead engine's last words\n")
    assert first == logs / "vllm-server-0.log"
    assert new_log(logs, "vllm-server-1") == logs / "vllm-server-1.log"
    assert new_log(logs, "vllm-server-0") == logs / "vllm-server-0.2.log"  # engine 0 replaced
    assert new_log(logs, "vllm-server-0") == logs / "vllm-server-0.3.log"
    assert new_log(logs, "vllm-router") == logs / "vllm-router.log"
    assert first.read_text() == "the dead engine's last words\n"
    assert (logs / "vllm-server-0.2.log").read_text() == ""


def test_outside_a_run_the_log_is_a_temporary_file(tmp_path):
    path = new_log(None, "vllm-router")
    try:
        assert path.parent == Path(tempfile.gettempdir()) and path.name.startswith("vimeflow-vllm-router-")
    finally:
        path.unlink()


def _web_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def test_a_temporary_log_is_removed_when_its_server_is_stopped():
    port = free_port("127.0.0.1")
    server = ServerProcess("web", _web_server(port), f"http://127.0.0.1:{port}", "/", log_dir=None, timeout_s=30)
    log = server.log_path
    assert log.is_file() and log.name.startswith("vimeflow-web-")
    server.stop()
    assert server.process.returncode is not None and not log.exists()


def test_a_run_log_stays_when_its_server_is_stopped(tmp_path):
    port = free_port("127.0.0.1")
    server = ServerProcess("web", _web_server(port), f"http://127.0.0.1:{port}", "/", log_dir=tmp_path, timeout_s=30)
    server.stop()
    assert server.log_path == tmp_path / "web.log" and server.log_path.is_file()


@pytest.mark.parametrize("in_run", [False, True])
def test_a_server_that_fails_to_start_keeps_its_log_and_the_error_names_it_and_quotes_it(tmp_path, in_run):
    fails = [sys.executable, "-c", "print('no model at /models/m', flush=True); raise SystemExit(3)"]
    with pytest.raises(RuntimeError) as failed:
        ServerProcess("vllm-server-0", fails, "http://127.0.0.1:9", "/health", log_dir=tmp_path if in_run else None)
    message = str(failed.value)
    assert message.startswith("vllm-server-0 exited with code 3 while starting")
    log = Path(message.split("the end of its log (")[1].split(")")[0])
    try:
        assert log.is_file() and (log == tmp_path / "vllm-server-0.log") == in_run
        assert message.endswith("\nno model at /models/m") and log.read_text() == "no model at /models/m\n"
    finally:
        log.unlink()


def test_a_server_that_is_not_ready_in_time_is_ended_and_keeps_its_temporary_log():
    slow = [sys.executable, "-c", "import time; print('loading the model', flush=True); time.sleep(60)"]
    with pytest.raises(TimeoutError) as late:
        ServerProcess("vllm-router", slow, f"http://127.0.0.1:{free_port('127.0.0.1')}", "/health", log_dir=None,
                      timeout_s=1)
    log = Path(str(late.value).split("the end of its log (")[1].split(")")[0])
    try:
        assert log.name.startswith("vimeflow-vllm-router-") and log.read_text() == "loading the model\n"
    finally:
        log.unlink()
