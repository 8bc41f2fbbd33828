"""Placing the trainer group and the rollout group on Ray, colocated or disaggregated, behind one facade.

Colocated: each trainer rank's actor also holds an engine on the rank's device (engine i beside rank i); every
rank gathers the full weights (collective) and loads them into its own engine in process memory. With
`--rollout-num-gpus-per-engine E` > 1, engine i is one vLLM engine tensor parallel over ranks iE … iE+E−1, a shard
in each rank's process (vLLM's external-launcher mode; `TensorParallelEngine`), and each rank loads the full
weights into its shard.
Disaggregated: the trainer group (vime_engine.runtime.trainer_group) and the rollout group of M engines
(vime_engine.runtime.rollout_group); weights move from the trainer's rank 0 to every engine through Ray's object
store or a bucketed collective broadcast (`--weight-sync`, see vime_engine.weight_sync.strategies), and after
each sync every engine must hold the new version.
Both return pending generations so the driver can overlap generation with training (async mode), and both
stream a round group by group for partial rollout (`Workers.stream`).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from vime_engine.config import EngineConfig
from vime_engine.data.records import PromptRecord
from vime_engine.rollout.cpu_shm import released_after_start
from vime_engine.rollout.worker import GenerationPlan, RolloutWorker
from vime_engine.devices.accelerator import Accelerator
from vime_engine.runtime.actor_start import start_up_without_collections
from vime_engine.runtime.memory_turns import check_memory_margin, check_memory_turn_flags, memory_turns
from vime_engine.runtime.placement import check_nodes_see, device_nodes, nodes_of, with_placement_decided
from vime_engine.runtime.rollout_group import EngineHandle, FaultTolerance, GroupRound, PendingSamples, RolloutGroup
from vime_engine.runtime.server_group import ServerRolloutGroup
from vime_engine.runtime.trainer_group import RankAddress, TrainerGroup, TrainerRank
from vime_engine.sample import Sample
from vime_engine.weight_sync.strategies import make_weight_sync

log = logging.getLogger(__name__)


class ColocatedActor(TrainerRank):
    """A trainer rank and a rollout engine in one process: the weight sync is a walk over the trainer's full
    tensors (gathered over the model-parallel ranks, so every rank of the group syncs at once), and the two take
    turns at the device's memory (vime_engine.runtime.memory_turns)."""

    def __init__(self, cfg: EngineConfig, accel: Accelerator, address: RankAddress, kv_cache_bytes: int | None):
        with start_up_without_collections():  # the trainer's and the engine's start-up, one collection at its end
            super().__init__(cfg, accel, address)
            per_engine = cfg.rollout.rollout_num_gpus_per_engine
            first = address.rank - address.rank % per_engine
            starting = (released_after_start(list(range(first, first + per_engine)), address.rank - first)
                        if per_engine > 1 and accel.kind == "cpu" else contextlib.nullcontext())
            with starting:
                self.rollout = RolloutWorker(cfg, kv_cache_bytes)
            self.memory = memory_turns(accel.kind, self.rollout.engine.llm, self.backend, accel.torch_device,
                                       cfg.placement.train_memory_margin_bytes,
                                       offload_trainer=not cfg.placement.no_offload_train)

    # The trainer's side: the device's memory is the trainer's first.
    def train(self, samples: list[Sample]) -> dict[str, float]:
        self.memory.for_training()
        return super().train(samples)

    def log_probs(self, samples: list[Sample]):
        self.memory.for_training()
        return super().log_probs(samples)

    def save_state(self, directory: str):
        self.memory.for_training()
        return super().save_state(directory)

    def load_state(self, directory: str, expected) -> None:
        self.memory.for_training()
        super().load_state(directory, expected)

    def save_hf(self, directory: str) -> str:
        self.memory.for_training()
        return super().save_hf(directory)

    # The engine's side.
    def generate(self, records, rollout_id, first_group, plan) -> list[Sample]:
        self.memory.for_generation()
        return self.rollout.generate(records, rollout_id, first_group, plan)

    def begin(self, records, resumed, rollout_id, first_group, plan) -> None:
        self.memory.for_generation()
        self.rollout.begin(records, resumed, rollout_id, first_group, plan)

    def advance(self) -> list[list[Sample]]:
        return self.rollout.advance()

    def abort(self) -> list[list[Sample]]:
        return self.rollout.abort()

    def sync_weights(self, version: int) -> float:
        self.memory.for_sync()
        return self.rollout.update_weights(self.backend.named_weights(), version)

    def loaded_weight_version(self) -> int:
        return self.rollout.weight_version

    def memory_calls(self) -> list[str]:
        """The hand-overs of the device's memory so far, in order (MemoryTurns.calls)."""
        return list(self.memory.calls)


class _OnEveryShard:
    """`engine.method.remote(...)` for an engine spread over ranks: the call goes to every rank (each shard must
    run it, in the same order, or the engine's collectives wait forever); the first rank's answer is the
    engine's (the shards sample the same tokens from the same gathered logits)."""

    def __init__(self, ranks: list[ActorHandle[ColocatedActor]], method: str):
        self.ranks, self.method = ranks, method

    def remote(self, *args, **kwargs) -> ray.ObjectRef:
        return [getattr(rank, self.method).remote(*args, **kwargs) for rank in self.ranks][0]


class TensorParallelEngine:
    """Engine i of a colocated run with `--rollout-num-gpus-per-engine E` > 1: one vLLM engine whose E tensor-
    parallel shards live in trainer ranks iE … iE+E−1, driven through the calls of `RolloutEngine`."""

    def __init__(self, ranks: list[ActorHandle[ColocatedActor]]):
        self.generate, self.begin, self.advance, self.abort, self.loaded_weight_version = (
            _OnEveryShard(ranks, name) for name in ("generate", "begin", "advance", "abort", "loaded_weight_version"))


def colocated_engines(ranks: list[ActorHandle[ColocatedActor]], per_engine: int) -> list[EngineHandle]:
    """The colocated run's engines: each rank's own, or one across each `per_engine` consecutive ranks."""
    if per_engine == 1:
        return list(ranks)
    return [TensorParallelEngine(ranks[i:i + per_engine]) for i in range(0, len(ranks), per_engine)]


def shared_run_files(cfg: EngineConfig) -> dict[str, str]:
    """What every node of a multi-node run must see, by flag: the model the ranks and engines load and the
    checkpoint directory the ranks write (made here, so that a first run has one to look for)."""
    if cfg.checkpoint.save:
        Path(cfg.checkpoint.save).mkdir(parents=True, exist_ok=True)
    files = {"--hf-checkpoint": cfg.model.hf_checkpoint, "--save": cfg.checkpoint.save,
             "--load": cfg.checkpoint.load, "--ref-load": cfg.checkpoint.ref_load}
    return {flag: path for flag, path in files.items() if path}


class Workers:
    """The driver's view of the trainer group and the rollout group, identical for both placements."""

    def __init__(self, cfg: EngineConfig, accel: Accelerator):
        cfg = with_placement_decided(cfg, accel.kind)
        check_memory_margin(cfg.placement.train_memory_margin_bytes, cfg.placement.colocate is True, accel.kind)
        check_memory_turn_flags(cfg.rollout.vllm_enable_sleep_mode, cfg.placement.no_offload_train,
                                cfg.placement.colocate is True, accel.kind)
        kv_cache_bytes = int(cfg.rollout.vllm_kv_cache_gb * 2**30) if accel.kind == "cpu" else None
        if len(nodes := device_nodes(accel)) > 1:  # a multi-node run: a shared file system, checked first
            check_nodes_see(nodes, shared_run_files(cfg))
        self.colocated = cfg.placement.colocate
        self.rollout_devices_per_engine = cfg.rollout.rollout_num_gpus_per_engine
        self.trainer: TrainerGroup | None = None
        self.rollout: RolloutGroup | None = None
        try:
            if self.colocated:
                self.trainer = TrainerGroup(cfg, accel, ColocatedActor, kv_cache_bytes)
                self.rollout = RolloutGroup(
                    colocated_engines(self.trainer.actors(), cfg.rollout.rollout_num_gpus_per_engine))
            elif cfg.placement.rollout_mode == "server":
                self.trainer = TrainerGroup(cfg, accel)
                self.rollout = ServerRolloutGroup.launch(cfg, accel, kv_cache_bytes, multi_node=len(nodes) > 1)
            else:
                self.trainer = TrainerGroup(cfg, accel)
                self.rollout = RolloutGroup.launch(cfg, accel, kv_cache_bytes)
            self.weight_sync = make_weight_sync(
                cfg.placement.weight_sync, self.trainer, self.rollout.weight_holders, self.colocated,
                accel.dist_backend, accel.torch_device, cfg.placement.weight_sync_bucket_mb,
            )
            self.weight_version: int | None = None  # the version every engine holds, once synced
            policy = FaultTolerance.of(cfg)
            if policy is not None:  # config_checks allows it only with the object-store sync
                self.rollout.watch(policy, lambda engine: self.weight_sync.sync_engine(engine, self.weight_version))
            log.info("placed on Ray: %s", self.placement())
        except BaseException:
            self.__exit__()  # a group that could not be placed must not keep the other's devices
            raise

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        """End the actors and free both groups' devices (placement groups outlive their actors)."""
        # After a lost node or raylet the cleanup itself can fail; the error that ended the run is the one to see.
        for group in (self.rollout, self.trainer):
            if group is not None:
                with contextlib.suppress(Exception):
                    group.shutdown()

    def placement(self) -> str:
        """Which Ray node holds each trainer rank's bundle and each engine's (short node ids), for the log."""
        trainer = f"trainer group on node(s) {', '.join(nodes_of(self.trainer.placement))}"
        if self.colocated:
            per_engine = self.rollout_devices_per_engine
            return f"{trainer}, " + ("each rank with its engine" if per_engine == 1 else
                                     f"each {per_engine} ranks with one tensor-parallel engine across them")
        return f"{trainer}; rollout engines on node(s) {', '.join(nodes_of(self.rollout.placement))}"

    def actors(self) -> list[ActorHandle]:
        """Every actor of the run (trainer ranks and engines), e.g. to wait until all have started."""
        if self.colocated:  # the engines live in the trainer's actors
            return self.trainer.actors()
        return [*self.trainer.actors(), *self.rollout.actors()]

    def generate(
        self, records: list[PromptRecord], rollout_id: int, first_group: int, plan: GenerationPlan,
    ) -> PendingSamples:
        """The rewarded samples, being generated (`.result()` waits for them)."""
        return self.rollout.generate(records, rollout_id, first_group, plan)

    def stream(
        self, records: list[PromptRecord], resumed: list[list[Sample]], rollout_id: int, first_group: int,
        plan: GenerationPlan,
    ) -> GroupRound:
        """Start a round on the rollout engines, to be read group by group (see RolloutWorker.begin)."""
        return self.rollout.stream(records, resumed, rollout_id, first_group, plan)

    def train(self, samples: list[Sample]) -> dict[str, float]:
        return self.trainer.train(samples)

    def sync_weights(self, version: int) -> float:
        """Push the trainer's weights to every rollout engine; seconds the slowest engine spent in its reload."""
        self.weight_version = version
        try:
            seconds = self.weight_sync.sync(version)
        except RayActorError:
            if self.rollout.fault_tolerance is None:
                raise
            self.rollout.replace_dead()  # each replacement loads `version`
            seconds = self.weight_sync.sync(version)
        self.rollout.check_weight_version(version)
        return seconds
