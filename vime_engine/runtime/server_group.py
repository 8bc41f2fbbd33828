"""`--rollout-mode server`: the rollout group's engines as vLLM API servers behind one vllm-router (vime's layout).

Engine i is a `ServerActor` in bundle i of the group's placement, holding its devices and running `vllm serve` as
a child process (vime_engine/rollout/server/vllm_server.py) registered with the router. The driver's calls go to
one `Dispatcher`: a RolloutWorker whose engine is the router (RouterEngine). It tokenizes, seeds every request as
the in-process engines do, and rewards the groups, so a round's samples are those of the in-process mode; the
router shares the requests out. Plugins and agents outside the driver reach the same servers through the router.

Weights go to every server: the object-store sync calls each ServerActor's `update_weights`, which hands the
tensors to the server's workers through its control endpoints and bumps the server's weight version; every
response names the version it was generated on, and the dispatcher refuses one that is not the synced version.

Servers and router listen on 127.0.0.1, or on their node's address when the run spans several nodes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime_engine.config import EngineConfig
from vime_engine.devices.accelerator import Accelerator, cpu_threads
from vime_engine.rollout.server.router import Router, RouterOptions
from vime_engine.rollout.server.router_engine import RouterAddress, RouterEngine
from vime_engine.rollout.server.vllm_server import ServerProcess, free_port, server_argv
from vime_engine.rollout.vllm_engine import engine_max_model_len
from vime_engine.rollout.worker import RolloutWorker, engine_settings
from vime_engine.runtime.placement import actor_resources
from vime_engine.runtime.rollout_group import RolloutGroup, reserve_engine_bundles

# Where a server's new weights are written for its workers to read: memory, not disk, where Linux has it.
WEIGHTS_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
SYNC_TIMEOUT_S = 600.0


def listen_host(multi_node: bool) -> str:
    """The address a server or the router binds: loopback, unless other nodes must reach it."""
    return ray.util.get_node_ip_address() if multi_node else "127.0.0.1"


def with_router(cfg: EngineConfig, router: Router) -> EngineConfig:
    """`cfg` naming `router` (`--vllm-router-ip/-port`), so that plugins find it in `args` as in vime."""
    placement = cfg.placement.model_copy(update={"vllm_router_ip": router.host, "vllm_router_port": router.port})
    return cfg.model_copy(update={"placement": placement})


def _unshared(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors as safetensors writes them: contiguous, none sharing memory with another (tied embeddings)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in named_tensors:
        tensor = tensor.detach().contiguous()
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        out[name] = tensor
    return out


class ServerActor:
    """One rollout engine as a vLLM API server on this actor's devices."""

    def __init__(self, cfg: EngineConfig, device_kind: str, kv_cache_bytes: int | None, multi_node: bool,
                 server_env: dict[str, str]):
        host = listen_host(multi_node)
        port = free_port(host)
        argv = server_argv(engine_settings(cfg, kv_cache_bytes), device_kind, host, port)
        env = {**server_env, "VLLM_SERVER_DEV_MODE": "1"}
        if device_kind == "cpu":  # the in-process engine's share of the cores (Ray gives a 1-CPU actor 1 thread)
            cores = len(os.sched_getaffinity(0))
            env["OMP_NUM_THREADS"] = str(cpu_threads(cores, cfg.rollout_engines, cfg.placement.async_rollout))
        self.server = ServerProcess("vllm-server", argv, f"http://{host}:{port}", "/health", env=env)
        self._http = httpx.Client(base_url=self.server.url, timeout=SYNC_TIMEOUT_S)
        self._set_version(0)  # the weights it loaded from --hf-checkpoint (vLLM names them "default")

    def _set_version(self, version: int) -> None:
        self._post("/update_weight_version", {"new_version": str(version)})
        self.weight_version = version

    def url(self) -> str:
        return self.server.url

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict, version: int) -> float:
        """Load new weights into the server's workers as `version`; returns seconds taken."""
        from safetensors.torch import save_file

        start = time.perf_counter()
        if isinstance(named_tensors, dict):
            named_tensors = named_tensors.items()
        path = WEIGHTS_DIR / f"vimeflow-weights-{os.getpid()}.safetensors"
        try:
            save_file(_unshared(named_tensors), str(path))
            self._post("/collective_rpc", {"method": "vime_reload", "args": [str(path)]})
        finally:
            path.unlink(missing_ok=True)
        self._post("/reset_prefix_cache", None)  # cached prefixes hold the old weights' keys and values
        self._set_version(version)
        return time.perf_counter() - start

    def _post(self, path: str, body: dict | None) -> None:
        response = self._http.post(path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"the server {self.server.url} answered {path} with HTTP {response.status_code}: "
                               f"{response.text[:500]}")

    def loaded_weight_version(self) -> int:
        return self.weight_version

    def stop(self) -> None:
        self.server.stop()


class Dispatcher(RolloutWorker):
    """The driver's one engine in server mode: rounds generated through the router."""

    def __init__(self, cfg: EngineConfig, address: RouterAddress):
        max_model_len = engine_max_model_len(engine_settings(cfg, kv_cache_bytes=None))
        timeout = cfg.placement.vllm_router_request_timeout_secs
        super().__init__(cfg, engine=RouterEngine(address, max_model_len, timeout))

    def set_weight_version(self, version: int) -> None:
        self.engine.weight_version = version

    def loaded_weight_version(self) -> int:
        return self.engine.weight_version


class ServerRolloutGroup(RolloutGroup):
    """The rollout group in server mode: the dispatcher is its one engine, the servers hold the weights."""

    def __init__(self, dispatcher, servers: list, urls: list[str], router: Router, placement):
        super().__init__([dispatcher], placement)
        self.servers, self.urls, self.router = servers, urls, router

    @classmethod
    def launch(cls, cfg: EngineConfig, accel: Accelerator, kv_cache_bytes: int | None,
               multi_node: bool) -> ServerRolloutGroup:
        placement = reserve_engine_bundles(cfg, accel)
        p = cfg.placement
        router = Router.start_or_join(
            RouterOptions(p.vllm_router_ip, p.vllm_router_port, p.router_policy, p.vllm_router_request_timeout_secs),
            listen_host(multi_node))
        servers, urls = [], []
        try:
            # The device's environment: on CPU that runs vLLM's engine core inside the server's process, which
            # starts in 29 s instead of 44 s (tiny Qwen3, one server alone) and leaves nothing behind a killed server.
            env = dict(accel.actor_env)
            remote = ray.remote(ServerActor)
            servers = [remote.options(
                **actor_resources(accel, cfg.rollout.rollout_num_gpus_per_engine),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement, i),
            ).remote(cfg, accel.kind, kv_cache_bytes, multi_node, env) for i in range(cfg.rollout_engines)]
            urls = ray.get([server.url.remote() for server in servers])
            for url in urls:
                router.add(url)
            dispatcher = ray.remote(Dispatcher).options(num_cpus=0).remote(
                with_router(cfg, router), RouterAddress(router.url, tuple(urls)))
            return cls(dispatcher, servers, urls, router, placement)
        except BaseException:
            cls._stop(servers, urls, router)
            raise

    def actors(self) -> list:
        return [*self.servers, *self.engines]

    @property
    def weight_holders(self) -> list:
        return self.servers

    def check_weight_version(self, version: int) -> None:
        super().check_weight_version(version)
        ray.get(self.engines[0].set_weight_version.remote(version))

    @staticmethod
    def _stop(servers: list, urls: list[str], router: Router) -> None:
        """Unregister and stop the servers, then the router if the run started it."""
        if router.process is None:  # an existing router outlives the run: only the servers leave it
            for url in urls:
                with contextlib.suppress(Exception):
                    router.remove(url)
        with contextlib.suppress(Exception):
            ray.get([server.stop.remote() for server in servers], timeout=30)
        router.stop()

    def shutdown(self) -> None:
        self._stop(self.servers, self.urls, self.router)
        for server in self.servers:
            with contextlib.suppress(Exception):
                ray.kill(server)
        super().shutdown()
