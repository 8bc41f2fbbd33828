"""One rollout engine as vLLM's OpenAI-compatible API server (`vllm serve`), a child process of its Ray actor.

The server runs the engine the in-process mode builds (`server_argv` turns the same EngineSettings into vLLM's
flags, with the same device choices), so a request generates the same tokens either way. Three flags belong to
the server mode: `--enable-scale-out` opens `/inference/v1/generate` (token ids in, token ids and log-probs out),
`--worker-extension-cls` adds the weight reload the sync calls through `/collective_rpc`
(vime_engine/rollout/server/weight_extension.py), and VLLM_SERVER_DEV_MODE=1 opens that endpoint.

Every server runs under a guard (vime_engine/rollout/server/server_guard.py) that ends the server's whole process
group when the server exits or the actor dies: a killed server, a killed actor or a stopped cluster leaves nothing
running, vLLM's engine core included.
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


class ServerProcess:
    """A server (vLLM's or the router) started from `argv` under its guard, waited for on `health_path`; its output
    in a log file whose tail an error shows. `process` is the guard's, which exits with the server's code."""

    def __init__(self, name: str, argv: list[str], url: str, health_path: str, env: dict[str, str] | None = None,
                 timeout_s: float = START_TIMEOUT_S):
        self.name, self.url = name, url
        self.log_path = Path(tempfile.mkstemp(prefix=f"vimeflow-{name}-", suffix=".log")[1])
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
        self.stop()
        raise TimeoutError(f"{self.name} was not ready on {self.url}{path} after {timeout_s:.0f} s; the end of its "
                           f"log ({self.log_path}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """End the server and every process it started (its guard's SIGTERM; a SIGKILL past the guard's grace)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=GRACE_S + 5)
            except subprocess.TimeoutExpired:
                self.process.kill()  # the server dies with its guard (its parent-death signal)
                self.process.wait()
