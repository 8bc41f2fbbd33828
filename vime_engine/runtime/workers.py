"""Placing the trainer group and the rollout engine on Ray, colocated or disaggregated, behind one facade.

Colocated: one actor holds a trainer of one rank and the engine; weights move in process memory.
Disaggregated: the trainer group (vime_engine.runtime.trainer_group) and a rollout actor; weights move from the
group's rank 0 through Ray's object store or a bucketed collective broadcast (`--weight-sync`, see
vime_engine.weight_sync.strategies).
Both return Ray futures for generation so the driver can overlap generation with training (async mode), and
both stream a round group by group for partial rollout (`Workers.stream`).
"""

from __future__ import annotations

import contextlib

import ray

from vime_engine.config import EngineConfig
from vime_engine.data.records import PromptRecord
from vime_engine.rollout.worker import GenerationPlan, RolloutWorker
from vime_engine.runtime.devices import Accelerator
from vime_engine.runtime.trainer_group import RankAddress, TrainerGroup, TrainerRank
from vime_engine.sample import Sample
from vime_engine.weight_sync.buckets import TensorSpec
from vime_engine.weight_sync.endpoints import BroadcastReceiver, load_into_engine
from vime_engine.weight_sync.group import GroupAddress
from vime_engine.weight_sync.strategies import make_weight_sync


class RolloutActor(RolloutWorker):
    """The disaggregated rollout engine; adds the receiving end of the broadcast weight sync."""

    receiver: BroadcastReceiver | None = None

    def open_weight_receiver(self, address: GroupAddress, specs: list[TensorSpec], bucket_bytes: int, device: str):
        self.receiver = BroadcastReceiver(address, specs, bucket_bytes, device)

    def receive_weights(self, version: int) -> float:
        return load_into_engine(self.engine, self.receiver.stream(version), version)


class ColocatedActor(TrainerRank):
    """A trainer rank (of a group of one) and the rollout engine in one process: the weight sync is a walk over
    the trainer's tensors."""

    def __init__(self, cfg: EngineConfig, accel: Accelerator, address: RankAddress, kv_cache_bytes: int | None):
        super().__init__(cfg, accel, address)
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
    """The driver's view of the trainer group and the rollout engine, identical for both placements."""

    def __init__(self, cfg: EngineConfig, accel: Accelerator):
        kv_cache_bytes = int(cfg.rollout.vllm_kv_cache_gb * 2**30) if accel.kind == "cpu" else None
        self.colocated = cfg.placement.colocate
        if self.colocated:
            self.trainer = TrainerGroup(cfg, accel, ColocatedActor, kv_cache_bytes)
            self.rollout = self.trainer.leader
        else:
            self.trainer = TrainerGroup(cfg, accel)
            resources = {"num_gpus": 1} if accel.ray_resource == "GPU" else (
                {"resources": {accel.ray_resource: 1}} if accel.ray_resource else {"num_cpus": 1}
            )
            self.rollout = ray.remote(RolloutActor).options(
                runtime_env={"env_vars": dict(accel.actor_env)}, **resources).remote(cfg, kv_cache_bytes)
        self.weight_sync = make_weight_sync(
            cfg.placement.weight_sync, self.trainer, self.rollout, self.colocated, accel.dist_backend,
            accel.torch_device, cfg.placement.weight_sync_bucket_mb,
        )

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        """End the actors and free the trainer group's devices (placement groups outlive their actors)."""
        # After a lost node or raylet the cleanup itself can fail; the error that ended the run is the one to see.
        with contextlib.suppress(Exception):
            self.trainer.shutdown()
            if not self.colocated:
                ray.kill(self.rollout)

    def actors(self) -> list:
        """Every actor of the run (trainer ranks and the engine), e.g. to wait until all have started."""
        return list(dict.fromkeys([*self.trainer.actors(), self.rollout]))

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
        return self.trainer.train(samples)

    def sync_weights(self, version: int) -> float:
        """Push the trainer's weights to the rollout engine; seconds spent inside the engine's reload."""
        return self.weight_sync.sync(version)
