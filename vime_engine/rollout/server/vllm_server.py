"""One rollout engine as vLLM's OpenAI-compatible API server (`vllm serve`), a child process of its Ray actor.

The server runs the engine the in-process mode builds (`server_argv` turns the same EngineSettings into vLLM's
flags, with the same device choices), so a request generates the same tokens either way. Three flags belong to
the server mode: `--enable-scale-out` opens `/inference/v1/generate` (token ids in, token ids and log-probs out),
`--worker-extension-cls` adds the weight reload the sync calls through `/collective_rpc`
(vime_engine/rollout/server/weight_extension.py), and VLLM_SERVER_DEV_MODE=1 opens that endpoint.

Every server runs under a guard (vime_engine/rollout/server/server_guard.py) that ends the server's whole process
group when the server exits or the actor dies: a killed server, a killed actor or a stopped cluster leaves nothing
running, vLLM's engine core included.

A server's output goes to a file of its own among the run's logs (`new_log`); a server started outside a run logs
to a temporary file, removed when the server is stopped and kept when it failed (its errors name the file).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vime_engine.rollout.server.server_guard import GRACE_S
from vime_engine.rollout.vllm_engine import EngineSettings, vllm_engine_args

WEIGHT_EXTENSION = "vime_engine.rollout.server.weight_extension.WeightReloadExtension"
START_TIMEOUT_S = 600.0


def server_argv(settings: EngineSettings, device_kind: str, host: str, port: int) -> list[str]:
    """The command line of `settings`' engine as an API server on host:port: the in-process engine's arguments
    (`vllm_engine_args`, a bool as `--flag` / `--no-flag`, a list as its values), plus the endpoints the server mode
    uses. Sleep mode is asked for on accelerators, where vLLM has it. Raises ValueError as `device_engine_kwargs`
    does."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port)]
    for name, value in vllm_engine_args(settings, device_kind, sleep_mode_available=device_kind != "cpu").items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv + ["--enable-scale-out", "--worker-extension-cls", WEIGHT_EXTENSION, "--disable-uvicorn-access-log"]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def new_log(log_dir: Path | None, name: str) -> Path:
    """A new, empty log file for the server `name`. In `log_dir` (the run's logs, made if missing) it is `name.log`,
    or `name.2.log`, `name.3.log`, … when the earlier ones exist: a replaced engine's log is the evidence of its
    death, and a resumed run's servers start again beside the first process's, so no log is ever overwritten (each
    file is created exclusively, so two processes never share one). Without `log_dir`: a temporary file,
    vimeflow-NAME-*.log."""
    if log_dir is None:
        fd, path = tempfile.mkstemp(prefix=f"vimeflow-{name}-", suffix=".log")
        os.close(fd)
        return Path(path)
    log_dir.mkdir(parents=True, exist_ok=True)
    start = 1
    while True:
        path = log_dir / (f"{name}.log" if start == 1 else f"{name}.{start}.log")
        try:
            path.touch(exist_ok=False)
            return path
        except FileExistsError:
            start += 1


class ServerProcess:
    """A server (vLLM's or the router) started from `argv` under its guard, waited for on `health_path`; its output
    in a log file (`new_log` in `log_dir`) whose tail an error shows. `process` is the guard's, which exits with the
    server's code."""

    def __init__(self, name: str, argv: list[str], url: str, health_path: str, log_dir: Path | None,
                 env: dict[str, str] | None = None, timeout_s: float = START_TIMEOUT_S):
        self.name, self.url = name, url
        self.log_path = new_log(log_dir, name)
        self._temporary_log = log_dir is None
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "vime_engine.rollout.server.server_guard", str(os.getpid()), *argv],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True,
            )
        self._wait_healthy(health_path, timeout_s)

    def _wait_healthy(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode} while starting; "
                                   f"the end of its log ({self.log_path}):\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        self._end()  # its log stays: the error names it
        raise TimeoutError(f"{self.name} was not ready on {self.url}{path} after {timeout_s:.0f} s; the end of its "
                           f"log ({self.log_path}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """End the server if it is running, and with it a temporary log; a server that exited by itself keeps its
        log, the evidence of why."""
        if self.process.poll() is None:
            self._end()
            if self._temporary_log:
                self.log_path.unlink(missing_ok=True)

    def _end(self) -> None:
        """End the server and every process it started (its guard's SIGTERM; a SIGKILL past the guard's grace)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=GRACE_S + 5)
        except subprocess.TimeoutExpired:
            self.process.kill()  # the server dies with its guard (its parent-death signal)
            self.process.wait()
