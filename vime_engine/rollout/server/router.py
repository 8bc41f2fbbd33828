"""vllm-router in front of the rollout group's servers: started by the run, or one the user runs already.

The router (PyPI `vllm-router`, in Rust) forwards `/inference/v1/generate`, `/v1/chat/completions` and the
rest of vLLM's API to the servers registered with it, picking one per request by its policy; vime's default
policy is consistent_hash, which keeps the requests of one `x-session-id` on one server. Servers join and leave
through the router's own API (`/add_worker`, `/remove_worker`), so an existing router (`--vllm-router-ip`)
is used the same way as one the run started.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from vime_engine.rollout.server.vllm_server import ServerProcess, free_port

@dataclass(frozen=True)
class RouterOptions:
    """vime's router flags: where an existing router listens (`--vllm-router-ip/-port`), or how to start one."""

    ip: str | None = None
    port: int | None = None
    policy: str = "consistent_hash"
    request_timeout_secs: int = 14400


def router_argv(options: RouterOptions, host: str, port: int, metrics_port: int) -> list[str]:
    """The command line of a router on host:port with `options`, no servers yet (they register themselves).

    Its Prometheus metrics go to `metrics_port`: the router's default, 29000 on every host, would make a second
    router on the machine (another run, or a user's) die at start with "Address already in use"."""
    executable = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    return [executable, "--host", host, "--port", str(port), "--policy", options.policy,
            "--request-timeout-secs", str(options.request_timeout_secs),
            "--prometheus-host", host, "--prometheus-port", str(metrics_port)]


class Router:
    """The router the servers register with at host:port: `url` for clients, `add` / `remove` for servers."""

    def __init__(self, host: str, port: int, process: ServerProcess | None = None):
        self.host, self.port, self.process = host, port, process

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def start_or_join(cls, options: RouterOptions, host: str, log_dir: Path | None) -> Router:
        """The router at `--vllm-router-ip:port` if given (it must answer /health), else a new one on `host`, its
        log in `log_dir` (ServerProcess)."""
        if options.ip is not None:
            router = cls(options.ip, options.port)
            try:
                httpx.get(router.url + "/health", timeout=10).raise_for_status()
            except httpx.HTTPError as error:
                raise RuntimeError(f"--vllm-router-ip {options.ip} --vllm-router-port {options.port}: no router "
                                   f"answers {router.url}/health ({error}); start it first or leave both flags "
                                   "out") from error
            return router
        port, metrics_port = free_port(host), free_port(host)
        return cls(host, port, ServerProcess("vllm-router", router_argv(options, host, port, metrics_port),
                                             f"http://{host}:{port}", "/health", log_dir, timeout_s=60))

    def add(self, server_url: str) -> None:
        httpx.post(self.url + "/add_worker", params={"url": server_url}, timeout=60).raise_for_status()

    def remove(self, server_url: str) -> None:
        httpx.post(self.url + "/remove_worker", params={"url": server_url}, timeout=60).raise_for_status()

    def workers(self) -> list[str]:
        body = httpx.get(self.url + "/list_workers", timeout=10).raise_for_status().json()
        return list(body.get("urls", body.get("workers", [])))

    def stop(self) -> None:
        """Stop the router if the run started it (an existing one is the user's)."""
        if self.process is not None:
            self.process.stop()
