"""One rollout engine as vLLM's OpenAI-compatible API server (`vllm serve`), a child process of its Ray actor.

The server runs the engine the in-process mode builds (`server_argv` turns the same EngineSettings into vLLM's
flags, with the same device choices), so a request generates the same tokens either way. Three flags belong to
the server mode: `--enable-scale-out` opens `/inference/v1/generate` (token ids in, token ids and log-probs out),
`--worker-extension-cls` adds the weight reload the sync calls through `/collective_rpc`
(vime_engine/rollout/server/weight_extension.py), and VLLM_SERVER_DEV_MODE=1 opens that endpoint.

The server is started in a session of its own and dies with the actor (the kernel's parent-death signal), so a
killed actor or a stopped cluster leaves no server running.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vime_engine.rollout.vllm_engine import EngineSettings, device_engine_kwargs

WEIGHT_EXTENSION = "vime_engine.rollout.server.weight_extension.WeightReloadExtension"
START_TIMEOUT_S = 600.0
_PR_SET_PDEATHSIG = 1


def server_argv(settings: EngineSettings, device_kind: str, max_model_len: int, host: str, port: int) -> list[str]:
    """The command line of `settings`' engine as an API server on host:port; the same engine as VLLMEngine builds
    (device choices from `device_engine_kwargs`), plus the endpoints the server mode uses. Raises ValueError as
    `device_engine_kwargs` does."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", settings.model_path, "--host", host, "--port", str(port),
        "--dtype", settings.dtype, "--seed", str(settings.seed), "--max-model-len", str(max_model_len),
        "--gpu-memory-utilization", str(settings.gpu_memory_utilization),
        "--tensor-parallel-size", str(settings.tensor_parallel_size),
        "--logprobs-mode", "processed_logprobs",  # as in-process: log-probs after temperature scaling
        "--enable-scale-out", "--worker-extension-cls", WEIGHT_EXTENSION,
        "--disable-uvicorn-access-log",
    ]
    if settings.kv_cache_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(settings.kv_cache_bytes)]
    if settings.enable_sleep_mode and device_kind != "cpu":
        argv.append("--enable-sleep-mode")
    engine = device_engine_kwargs(device_kind, settings.tuning, max_model_len)
    if engine["enforce_eager"]:
        argv.append("--enforce-eager")
    for name in ("enable_prefix_caching", "enable_chunked_prefill"):
        flag = name.replace("_", "-")
        argv.append(f"--{flag}" if engine[name] else f"--no-{flag}")
    if "max_num_batched_tokens" in engine:
        argv += ["--max-num-batched-tokens", str(engine["max_num_batched_tokens"])]
    return argv


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ServerProcess:
    """A server (vLLM's or the router) started from `argv`, waited for on `health_path`; its output in a log file
    whose tail an error shows."""

    def __init__(self, name: str, argv: list[str], url: str, health_path: str, env: dict[str, str] | None = None,
                 timeout_s: float = START_TIMEOUT_S):
        self.name, self.url = name, url
        self.log_path = Path(tempfile.mkstemp(prefix=f"vimeflow-{name}-", suffix=".log")[1])
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                start_new_session=True, preexec_fn=_die_with_parent,
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
        """End the server and every process it started (its session)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
