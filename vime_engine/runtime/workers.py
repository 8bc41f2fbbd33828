"""Placing the trainer and the rollout engine on Ray, colocated or disaggregated, behind one facade.

Colocated: one actor holds both; weights move in process memory. Disaggregated: a trainer actor and a rollout
actor; weights move through Ray's object store or a bucketed collective broadcast (`--weight-sync`, see
vime_engine.weight_sync.strategies).
Both return Ray futures for generation so the driver can overlap generation with training (async mode), and
both stream a round group by group for partial rollout (`Workers.stream`).
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from vime_engine.config import EngineConfig
from vime_engine.data.records import PromptRecord
from vime_engine.rollout.worker import GenerationPlan, RolloutWorker
from vime_engine.runtime.devices import Accelerator
from vime_engine.sample import Sample
from vime_engine.train.torch_backend import TorchTrainBackend
from vime_engine.weight_sync.buckets import TensorSpec, specs_of
from vime_engine.weight_sync.endpoints import BroadcastReceiver, BroadcastSender, load_into_engine
from vime_engine.weight_sync.group import GroupAddress
from vime_engine.weight_sync.strategies import make_weight_sync


def build_trainer(cfg: EngineConfig, device: str):
    """The `--train-backend`: both implement the same contract (see train/torch_backend.py)."""
    if cfg.train.train_backend == "megatron":
        # Imported here: megatron-core is only installed where it runs (the CUDA / NPU images, the 3.12 lane).
        from vime_engine.train.megatron_backend import MegatronTrainBackend

        return MegatronTrainBackend(cfg, device)
    return TorchTrainBackend(cfg, device)


class TrainerActor:
    """The training backend inside an actor; weights leave it as a plain dict (one object-store put)."""

    def __init__(self, cfg: EngineConfig, device: str):
        self.backend = build_trainer(cfg, device)
        self.device = device
        self.sender: BroadcastSender | None = None

    def train(self, samples: list[Sample]) -> dict[str, float]:
        return self.backend.train_rollout(samples)

    def weights(self) -> dict[str, torch.Tensor]:
        return dict(self.backend.named_weights())

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.backend, method)(*args)

    def weight_specs(self) -> list[TensorSpec]:
        return specs_of(self.backend.named_weights())

    def open_weight_sender(self, dist_backend: str, bucket_bytes: int) -> GroupAddress:
        self.sender = BroadcastSender(dist_backend, self.device, bucket_bytes)
        return self.sender.address

    def send_weights(self, version: int) -> int:
        return self.sender.send(self.backend.named_weights(), version)


class RolloutActor(RolloutWorker):
    """The disaggregated rollout engine; adds the receiving end of the broadcast weight sync."""

    receiver: BroadcastReceiver | None = None

    def open_weight_receiver(self, address: GroupAddress, specs: list[TensorSpec], bucket_bytes: int, device: str):
        self.receiver = BroadcastReceiver(address, specs, bucket_bytes, device)

    def receive_weights(self, version: int) -> float:
        return load_into_engine(self.engine, self.receiver.stream(version), version)


class ColocatedActor(TrainerActor):
    """Trainer and rollout engine in one process: the weight sync is a walk over the trainer's tensors."""

    def __init__(self, cfg: EngineConfig, device: str, kv_cache_bytes: int | None):
        super().__init__(cfg, device)
        self.rollout = RolloutWorker(cfg, kv_cache_bytes)

    def generate(self, records, rollout_id, first_group, plan) -> list[Sample]:
        return self.rollout.generate(records, rollout_id, first_group, plan)

    def begin(self, records, resumed, rollout_id, first_group, plan) -> None:
        self.rollout.begin(records, resumed, rollout_id, first_group, plan)

    def advance(self) -> list[list[Sample]]:
        return self.rollout.advance()

    def abort(self) -> list[list[Sample]]:
        return self.rollout.abort()

    def sync_weights(self, version: int) -> float:
        return self.rollout.update_weights(self.backend.named_weights(), version)


class EngineRound:
    """A round running on the rollout actor (a `RoundStream`): each call is one round trip."""

    def __init__(self, rollout):
        self.rollout = rollout

    def advance(self) -> list[list[Sample]]:
        return ray.get(self.rollout.advance.remote())

    def abort(self) -> list[list[Sample]]:
        return ray.get(self.rollout.abort.remote())


class Workers:
    """The driver's view of the actors, identical for both placements."""

    def __init__(self, cfg: EngineConfig, accel: Accelerator):
        env = {"runtime_env": {"env_vars": dict(accel.actor_env)}}
        kv_cache_bytes = int(cfg.rollout.vllm_kv_cache_gb * 2**30) if accel.kind == "cpu" else None
        resources = {"num_gpus": 1} if accel.ray_resource == "GPU" else (
            {"resources": {accel.ray_resource: 1}} if accel.ray_resource else {"num_cpus": 1}
        )
        self.colocated = cfg.placement.colocate
        if self.colocated:
            actor = ray.remote(ColocatedActor).options(**env, **resources).remote(
                cfg, accel.torch_device, kv_cache_bytes)
            self.trainer = self.rollout = actor
        else:
            self.trainer = ray.remote(TrainerActor).options(**env, **resources).remote(cfg, accel.torch_device)
            self.rollout = ray.remote(RolloutActor).options(**env, **resources).remote(cfg, kv_cache_bytes)
        self.weight_sync = make_weight_sync(
            cfg.placement.weight_sync, self.trainer, self.rollout, self.colocated, accel.dist_backend,
            accel.torch_device, cfg.placement.weight_sync_bucket_mb,
        )

    def generate(self, records: list[PromptRecord], rollout_id: int, first_group: int, plan: GenerationPlan):
        """A future of the rewarded samples."""
        return self.rollout.generate.remote(records, rollout_id, first_group, plan)

    def stream(
        self, records: list[PromptRecord], resumed: list[list[Sample]], rollout_id: int, first_group: int,
        plan: GenerationPlan,
    ) -> EngineRound:
        """Start a round on the rollout engine, to be read group by group (see RolloutWorker.begin)."""
        ray.get(self.rollout.begin.remote(records, resumed, rollout_id, first_group, plan))
        return EngineRound(self.rollout)

    def train(self, samples: list[Sample]) -> dict[str, float]:
        return ray.get(self.trainer.train.remote(samples))

    def sync_weights(self, version: int) -> float:
        """Push the trainer's weights to the rollout engine; seconds spent inside the engine's reload."""
        return self.weight_sync.sync(version)

    def trainer_call(self, method: str, *args: Any) -> Any:
        return ray.get(self.trainer.call.remote(method, *args))
