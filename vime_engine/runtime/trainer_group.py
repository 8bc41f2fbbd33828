"""The trainer group: `--actor-num-nodes × --actor-num-gpus-per-node` trainer ranks on Ray, driven as one object.

Placement: one placement-group bundle per node holding that node's devices (`--actor-num-gpus-per-node` GPUs /
NPUs, or as many CPUs on CPU, where a "device" is one Ray CPU), STRICT_SPREAD over `--actor-num-nodes` nodes, so
the counts are honoured exactly: ranks of one node share its bundle, rank = node × per_node + local rank.
Before the ranks start, a probe on bundle 0's node picks the rendezvous address (that node's IP, a free port);
each rank gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` and joins torch.distributed
on the accelerator's backend (gloo / nccl / hccl) before it builds its training backend.

Every call goes to all ranks at once (the backends' methods are collective, vime_engine.train.backend) and
returns rank 0's result; rank 0 is also the source of the weights sent to the rollout engine.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime_engine.config import ConfigError, EngineConfig
from vime_engine.checkpoint.manifest import FileEntry
from vime_engine.devices.accelerator import Accelerator, use_cpu_share
from vime_engine.runtime.actor_start import start_up_without_collections
from vime_engine.runtime.placement import actor_resources, bundle_node_ids, bundle_resources, describe, reserve
from vime_engine.sample import Sample
from vime_engine.train.backend import TrainBackend, build_train_backend
from vime_engine.weight_sync.buckets import TensorSpec, specs_of

if TYPE_CHECKING:  # torch is the ranks' (and the weight sync's), not the driver's: bench/startup.py
    import torch

    from vime_engine.weight_sync.endpoints import BroadcastSender
    from vime_engine.weight_sync.group import GroupAddress

DIST_TIMEOUT = timedelta(minutes=30)  # a collective may wait behind a whole rollout on another rank


@dataclass(frozen=True)
class RankAddress:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    def env(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def join_process_group(address: RankAddress, dist_backend: str) -> None:
    """Make this process rank `address.rank` of the trainer world (a world of one needs no group)."""
    import torch.distributed

    os.environ.update(address.env())
    if address.world_size > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            dist_backend, rank=address.rank, world_size=address.world_size, timeout=DIST_TIMEOUT,
        )


class TrainerRank:
    """One rank of the trainer group: a training backend in its own process."""

    def __init__(self, cfg: EngineConfig, accel: Accelerator, address: RankAddress):
        with start_up_without_collections():
            if accel.kind == "cpu":
                use_cpu_share(cfg.placement.actor_num_gpus_per_node, cfg.placement.async_rollout)
            join_process_group(address, accel.dist_backend)
            self.rank = address.rank
            self.device = accel.torch_device
            self.backend: TrainBackend = build_train_backend(cfg, accel.torch_device)
            self.sender: BroadcastSender | None = None

    def train(self, samples: list[Sample]) -> dict[str, float]:
        return self.backend.train_rollout(samples)

    def log_probs(self, samples: list[Sample]) -> torch.Tensor:
        return self.backend.log_probs(samples)

    def weights(self) -> dict[str, torch.Tensor] | None:
        """Rank 0: the full weights as one dict (one object-store put); other ranks take part in the gather."""
        weights = dict(self.backend.named_weights())
        return weights if self.rank == 0 else None

    def save_state(self, directory: str) -> dict[str, FileEntry]:
        return self.backend.save_state(directory)

    def load_state(self, directory: str, expected: dict[str, FileEntry]) -> None:
        self.backend.load_state(directory, expected)

    def save_hf(self, directory: str) -> str:
        return str(self.backend.save_hf(directory))

    # -- the trainer's end of the broadcast weight sync (rank 0 sends; the others take part in the gather) -----
    def weight_specs(self) -> list[TensorSpec]:
        return specs_of(self.backend.named_weights())

    def open_weight_sender(self, dist_backend: str, bucket_bytes: int, receivers: int) -> GroupAddress:
        from vime_engine.weight_sync.endpoints import BroadcastSender

        self.sender = BroadcastSender(dist_backend, self.device, bucket_bytes, receivers)
        return self.sender.address

    def send_weights(self, version: int) -> int:
        if self.sender is None:
            for _ in self.backend.named_weights():
                pass
            return 0
        return self.sender.send(self.backend.named_weights(), version)


def _rendezvous_probe() -> tuple[str, int]:
    """This node's address and a port free on it."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return ray.util.get_node_ip_address(), probe.getsockname()[1]


def _rendezvous(group: PlacementGroup) -> tuple[str, int]:
    """Rank 0's node address and a free port there: probed by the driver itself when bundle 0 is on its node (a
    task would start a Ray worker process just to answer, about 2 s before any rank can start), else by a task
    inside bundle 0."""
    if bundle_node_ids(group)[0] == ray.get_runtime_context().get_node_id():
        return _rendezvous_probe()
    in_bundle_0 = PlacementGroupSchedulingStrategy(group, 0)
    return ray.get(ray.remote(num_cpus=0)(_rendezvous_probe).options(scheduling_strategy=in_bundle_0).remote())


def world_size(cfg: EngineConfig) -> int:
    return cfg.placement.actor_num_nodes * cfg.placement.actor_num_gpus_per_node


def _place(cfg: EngineConfig, accel: Accelerator) -> PlacementGroup:
    """One bundle per node, on distinct nodes; fails naming the flags when the cluster cannot hold them."""
    p = cfg.placement
    bundle = bundle_resources(accel, p.actor_num_gpus_per_node)
    fitting = [node for node in ray.nodes() if node["Alive"]
               and all(node["Resources"].get(k, 0) >= v for k, v in bundle.items())]
    asked = (f"--actor-num-nodes {p.actor_num_nodes} × --actor-num-gpus-per-node {p.actor_num_gpus_per_node} "
             f"({describe(bundle)} on each of {p.actor_num_nodes} node(s))")
    if len(fitting) < p.actor_num_nodes:
        raise ConfigError(
            f"{asked}: the Ray cluster has {len(fitting)} node(s) that large; lower the counts or add nodes"
        )
    return reserve([bundle] * p.actor_num_nodes, "STRICT_SPREAD" if p.actor_num_nodes > 1 else "PACK", asked)


class TrainerGroup:
    """The driver's handle on all trainer ranks; `actor_class` lets the colocated placement add an engine."""

    def __init__(self, cfg: EngineConfig, accel: Accelerator, actor_class: type = TrainerRank, *extra: Any):
        p = cfg.placement
        self.placement = _place(cfg, accel)
        in_bundle = lambda node: PlacementGroupSchedulingStrategy(self.placement, node)  # noqa: E731
        host, port = _rendezvous(self.placement)
        env = {"runtime_env": {"env_vars": dict(accel.actor_env)}}
        remote_class = ray.remote(actor_class)
        self.ranks: list[ActorHandle[TrainerRank]] = [
            remote_class.options(**env, **actor_resources(accel), scheduling_strategy=in_bundle(node)).remote(
                cfg, accel, RankAddress(node * p.actor_num_gpus_per_node + local, world_size(cfg), local, host, port),
                *extra,
            )
            for node in range(p.actor_num_nodes) for local in range(p.actor_num_gpus_per_node)
        ]
        self.leader = self.ranks[0]

    def _on_all(self, call) -> Any:
        """`call(rank_actor)` on every rank at once (the methods are collective); rank 0's result."""
        return ray.get([call(rank) for rank in self.ranks])[0]

    def train(self, samples: list[Sample]) -> dict[str, float]:
        shared = ray.put(samples)  # one copy in the object store, read by every rank
        return self._on_all(lambda r: r.train.remote(shared))

    def log_probs(self, samples: list[Sample]) -> torch.Tensor:
        shared = ray.put(samples)
        return self._on_all(lambda r: r.log_probs.remote(shared))

    def save_state(self, directory: str) -> dict[str, FileEntry]:
        return self._on_all(lambda r: r.save_state.remote(directory))

    def load_state(self, directory: str, expected: dict[str, FileEntry]) -> None:
        self._on_all(lambda r: r.load_state.remote(directory, expected))

    def save_hf(self, directory: str) -> str:
        return self._on_all(lambda r: r.save_hf.remote(directory))

    def weights(self) -> dict[str, torch.Tensor]:
        return self._on_all(lambda r: r.weights.remote())

    def weights_ref(self) -> tuple[ray.ObjectRef, list[ray.ObjectRef]]:
        """Rank 0's weights as an object ref (to hand to the engine without a driver copy), and the other
        ranks' calls to wait for once it is consumed."""
        refs = [rank.weights.remote() for rank in self.ranks]
        return refs[0], refs[1:]

    def open_weight_sender(
        self, dist_backend: str, bucket_bytes: int, receivers: int,
    ) -> tuple[GroupAddress, list[TensorSpec]]:
        """Rank 0 serves the broadcast group's store for `receivers` engines; every rank's tensor specs."""
        address = ray.get(self.leader.open_weight_sender.remote(dist_backend, bucket_bytes, receivers))
        return address, self._on_all(lambda r: r.weight_specs.remote())

    def send_weights(self, version: int) -> list[ray.ObjectRef]:
        return [rank.send_weights.remote(version) for rank in self.ranks]

    def actors(self) -> list[ActorHandle[TrainerRank]]:
        return list(self.ranks)

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)
        remove_placement_group(self.placement)
