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

Fault tolerance (`--use-fault-tolerance`): while the driver waits for generation it watches the servers as the
in-process mode watches its engines. Each ServerActor answers one long call, `exited`, when its server's process
ends, so a death is seen at once; every `--rollout-health-check-interval` seconds each server must answer its
/health within `--rollout-health-check-timeout`. A dead or silent server is removed from the router (which stops
sending it work), its actor and every process of the server end, and a new ServerActor in the same bundle loads
the current weights before it registers with the router. The dispatcher posts the requests that failed with the
server again, with the same seeds (the router re-sends them to another server itself where it can), so the
rollout's samples are those of a run without the death. A ServerActor whose server has exited ends itself when
called, so a weight sync to it fails as one to a dead in-process engine does, and is repeated after the restart.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime_engine.config import EngineConfig
from vime_engine.devices.accelerator import Accelerator, cpu_share
from vime_engine.rollout.server.router import Router, RouterOptions
from vime_engine.rollout.server.router_engine import RouterAddress, RouterEngine
from vime_engine.rollout.server.server_guard import GRACE_S
from vime_engine.rollout.server.vllm_server import ServerProcess, free_port, server_argv
from vime_engine.rollout.vllm_engine import engine_max_model_len
from vime_engine.rollout.worker import RolloutWorker, engine_settings
from vime_engine.runtime.actor_start import start_up_without_collections
from vime_engine.runtime.placement import actor_resources
from vime_engine.runtime.rollout_group import HEALTH, GenerateCall, RolloutGroup, reserve_engine_bundles
from vime_engine.sample import Sample

if TYPE_CHECKING:  # the servers' actors hold the tensors, not the driver
    import torch

log = logging.getLogger(__name__)
# Where a server's new weights are written for its workers to read: memory, not disk, where Linux has it.
WEIGHTS_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
SYNC_TIMEOUT_S = 600.0
WATCH = "watch"  # the concurrency group `exited` waits in


class ServerDied(RuntimeError):
    """A server of the rollout group exited, or failed a health check."""


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
    """Rollout engine `index` as a vLLM API server on this actor's devices, logging to `log_dir`/vllm-server-<index>.log
    (or .2.log, … after a restart: `new_log`)."""

    def __init__(self, cfg: EngineConfig, index: int, device_kind: str, kv_cache_bytes: int | None, multi_node: bool,
                 server_env: dict[str, str], log_dir: Path):
        host = listen_host(multi_node)
        port = free_port(host)
        argv = server_argv(engine_settings(cfg, kv_cache_bytes), device_kind, host, port)
        env = {**server_env, "VLLM_SERVER_DEV_MODE": "1"}
        if device_kind == "cpu":  # the in-process engine's share of the cores (Ray gives a 1-CPU actor 1 thread)
            env["OMP_NUM_THREADS"] = str(cpu_share(cfg.rollout_engines, cfg.placement.async_rollout))
        self.server = ServerProcess(f"vllm-server-{index}", argv, f"http://{host}:{port}", "/health", log_dir,
                                    env=env)
        self._http = httpx.Client(base_url=self.server.url, timeout=SYNC_TIMEOUT_S)
        self._health_timeout = cfg.rollout.rollout_health_check_timeout
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
        try:
            response = self._http.post(path, json=body)
        except httpx.TransportError:
            self._end_if_server_exited(wait_s=GRACE_S)
            raise
        if response.status_code != 200:
            raise RuntimeError(f"the server {self.server.url} answered {path} with HTTP {response.status_code}: "
                               f"{response.text[:500]}")

    def _end_if_server_exited(self, wait_s: float = 0.0) -> None:
        """End this actor if its server has exited (within `wait_s`): the caller sees the engine's death as
        Ray's RayActorError, as with an in-process engine. The server's guard has ended its processes."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.server.process.wait(timeout=wait_s)
        if self.server.process.returncode is not None:
            print(f"the vLLM server {self.server.url} exited with code {self.server.process.returncode}: ending its "
                  f"actor; the end of its log ({self.server.log_path}):\n{self.server.log_tail()}", flush=True)
            os._exit(1)

    @ray.method(concurrency_group=HEALTH)
    def health(self) -> int:
        """Answers while the server answers its /health in time: the server's guard's process id."""
        self._end_if_server_exited()
        httpx.get(self.server.url + "/health", timeout=self._health_timeout).raise_for_status()
        return self.server.process.pid

    @ray.method(concurrency_group=WATCH)
    def exited(self) -> tuple[int, str]:
        """Returns when the server's process ends (its exit code, and its log's path on this actor's node): the
        driver waits on it to see a death at once."""
        return self.server.process.wait(), str(self.server.log_path)

    def loaded_weight_version(self) -> int:
        return self.weight_version

    def stop(self) -> None:
        self.server.stop()


class Dispatcher(RolloutWorker):
    """The driver's one engine in server mode: rounds generated through the router."""

    def __init__(self, cfg: EngineConfig, address: RouterAddress):
        with start_up_without_collections():
            max_model_len = engine_max_model_len(engine_settings(cfg, kv_cache_bytes=None))
            timeout = cfg.placement.vllm_router_request_timeout_secs
            super().__init__(cfg, engine=RouterEngine(address, max_model_len, timeout,
                                                      resend=cfg.rollout.use_fault_tolerance))

    def set_weight_version(self, version: int) -> None:
        self.engine.weight_version = version

    def set_server_urls(self, urls: list[str]) -> None:
        """The servers behind the router now (one restarted), which `abort` reaches."""
        self.engine.address = RouterAddress(self.engine.address.url, tuple(urls))

    def loaded_weight_version(self) -> int:
        return self.engine.weight_version


class ServerRolloutGroup(RolloutGroup):
    """The rollout group in server mode: the dispatcher is its one engine, the servers hold the weights."""

    def __init__(self, dispatcher, servers: list, urls: list[str], router: Router, placement, start_server):
        super().__init__([dispatcher], placement, start_server)
        self.servers, self.urls, self.router = servers, urls, router
        self._started = [time.monotonic()] * len(servers)
        self._exits: list[ray.ObjectRef] = []  # each server's `exited` call, while fault tolerance watches

    @classmethod
    def launch(cls, cfg: EngineConfig, accel: Accelerator, kv_cache_bytes: int | None,
               multi_node: bool) -> ServerRolloutGroup:
        placement = reserve_engine_bundles(cfg, accel)
        p = cfg.placement
        log_dir = cfg.logging.log_dir.resolve()  # absolute: an actor's working directory need not be the driver's
        router = Router.start_or_join(
            RouterOptions(p.vllm_router_ip, p.vllm_router_port, p.router_policy, p.vllm_router_request_timeout_secs),
            listen_host(multi_node), log_dir)
        # The device's environment, as an in-process engine's actor gets it. vLLM's API server runs its engine core
        # as a process of its own all the same (VLLM::EngineCore, on CPU too); the server's guard ends it with the
        # server.
        env = dict(accel.actor_env)
        remote = ray.remote(concurrency_groups={HEALTH: 1, WATCH: 1})(ServerActor)

        def start_server(i: int):
            return remote.options(
                **actor_resources(accel, cfg.rollout.rollout_num_gpus_per_engine),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement, i),
            ).remote(cfg, i, accel.kind, kv_cache_bytes, multi_node, env, log_dir)

        servers, urls = [], []
        try:
            servers = [start_server(i) for i in range(cfg.rollout_engines)]
            urls = ray.get([server.url.remote() for server in servers])
            for url in urls:
                router.add(url)
            dispatcher = ray.remote(Dispatcher).options(num_cpus=0).remote(
                with_router(cfg, router), RouterAddress(router.url, tuple(urls)))
            return cls(dispatcher, servers, urls, router, placement, start_server)
        except BaseException:
            cls._stop(servers, urls, router)
            raise

    # -- fault tolerance ------------------------------------------------------------------------------------------
    def watch(self, policy, resync) -> None:
        super().watch(policy, resync)
        self._exits = [server.exited.remote() for server in self.servers]

    def collect(self, calls: list[GenerateCall]) -> list[list[Sample]]:
        """The dispatcher's samples; meanwhile a server that exits or fails a health check is replaced (the module's
        doc says how), and one seen dead when the samples are in is replaced before they are returned."""
        policy, refs = self.fault_tolerance, [call.ref for call in calls]
        next_check = time.monotonic() + policy.interval
        while True:
            ray.wait(refs + self._exits, num_returns=1, timeout=max(0.0, next_check - time.monotonic()))
            finished = len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)
            dead = self._exited()
            if time.monotonic() >= next_check and not finished:
                dead.update({i: ServerDied(f"{self.urls[i]}: {error}") for i, error in
                             self._unhealthy(set(range(len(self.servers))) - set(dead)).items()})
                next_check = time.monotonic() + policy.interval
            for server, error in sorted(dead.items()):
                self.replace(server, error)
            if finished:
                return ray.get(refs)

    def _exited(self) -> dict[int, BaseException]:
        """The servers whose `exited` call has returned (or failed with their actor), each with why."""
        done, _ = ray.wait(self._exits, num_returns=len(self._exits), timeout=0)
        dead = {}
        for i, ref in enumerate(self._exits):
            if ref in done:
                try:
                    code, log = ray.get(ref)
                    dead[i] = ServerDied(f"the server {self.urls[i]} exited with code {code} (its log: {log})")
                except RayActorError as error:
                    dead[i] = error
        return dead

    def _retire(self, server: int) -> None:
        """Take a dead server out of the router first (it stops sending it work), then end its actor and what is
        left of the server (its guard ends the server's processes)."""
        url = self.urls[server]
        try:
            self.router.remove(url)
            log.warning("removed the server %s from the router", url)
        except httpx.HTTPError as error:
            log.warning("the router did not remove the server %s: %s", url, error)
        with contextlib.suppress(Exception):
            ray.get(self.servers[server].stop.remote(), timeout=GRACE_S + 5)
        with contextlib.suppress(Exception):
            ray.kill(self.servers[server], no_restart=True)

    def replace(self, server: int, error: BaseException) -> None:
        """A new server in the dead one's bundle, loaded with the current weights (RolloutGroup.replace), then
        registered with the router and the dispatcher, and watched."""
        super().replace(server, error)
        new = self.servers[server]
        self.urls[server] = ray.get(new.url.remote())
        self.router.add(self.urls[server])
        ray.get(self.engines[0].set_server_urls.remote(self.urls))
        if self._exits:
            self._exits[server] = new.exited.remote()
        log.warning("the new server %s of rollout engine %d joined the router", self.urls[server], server)

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
