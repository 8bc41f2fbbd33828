"""EngineConfig: the sections in one validated object, the values derived from them, and the fields a resumed
checkpoint must match (the math fields) versus those it may change (marked where declared: `non_math` in
sections.py)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vime_engine.config.checks import check_combinations
from vime_engine.config.errors import flag_name
from vime_engine.config.sections import (
    NON_MATH_FIELDS, SECTIONS, AlgorithmConfig, CheckpointConfig, DataConfig, EvalConfig, LoggingConfig, ModelConfig,
    PlacementConfig, RewardConfig, RolloutConfig, TrainConfig,
)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainConfig = TrainConfig()
    placement: PlacementConfig = PlacementConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    megatron: dict[str, Any] = Field(default_factory=dict, description="Megatron-Core flags, passed through")

    @model_validator(mode="after")
    def _check_combinations(self) -> EngineConfig:
        check_combinations(self)
        return self

    # -- derived values -------------------------------------------------------------------------------------
    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def global_batch_size(self) -> int:
        if self.train.global_batch_size is not None:
            return self.train.global_batch_size
        return self.samples_per_rollout // (self.train.num_steps_per_rollout or 1)

    @property
    def trainer_world_size(self) -> int:
        """Trainer ranks: `--actor-num-nodes × --actor-num-gpus-per-node`."""
        return self.placement.actor_num_nodes * self.placement.actor_num_gpus_per_node

    @property
    def rollout_engines(self) -> int:
        """vLLM engines of the rollout group: `--rollout-num-gpus / --rollout-num-gpus-per-engine` (one without
        `--rollout-num-gpus`); colocated, one across each `--rollout-num-gpus-per-engine` trainer ranks."""
        r = self.rollout
        if self.placement.colocate is True:
            return self.trainer_world_size // r.rollout_num_gpus_per_engine
        return 1 if r.rollout_num_gpus is None else r.rollout_num_gpus // r.rollout_num_gpus_per_engine

    @property
    def model_parallel_size(self) -> int:
        """Tensor × pipeline × context parallel size (1 for the torch backend)."""
        m = self.megatron
        return (m.get("tensor-model-parallel-size") or 1) * (m.get("pipeline-model-parallel-size") or 1) * (
            m.get("context-parallel-size") or 1)

    @property
    def data_parallel_size(self) -> int:
        return self.trainer_world_size // self.model_parallel_size

    @property
    def eps_clip_high(self) -> float:
        return self.algorithm.eps_clip if self.algorithm.eps_clip_high is None else self.algorithm.eps_clip_high

    @property
    def eval_datasets(self) -> list[tuple[str, str]]:
        items = self.eval.eval_prompt_data or []
        return list(zip(items[0::2], items[1::2]))

    def flat(self) -> dict[str, Any]:
        """All fields by their flat (flag) names."""
        out: dict[str, Any] = {}
        for section in SECTIONS:
            out.update(getattr(self, section).model_dump())
        out.update({f"megatron.{k}": v for k, v in self.megatron.items()})
        return out

    def _non_math_fields(self) -> set[str]:
        # The run length sets the LR schedule's length unless the LR is constant or the decay length is given.
        if self.train.lr_decay_style != "constant" and self.train.lr_decay_iters is None:
            return NON_MATH_FIELDS - {"num_rollout"}
        return NON_MATH_FIELDS

    def math_fields(self) -> dict[str, Any]:
        """The fields that change the trained weights; a checkpoint resumes only under equal values."""
        skip = self._non_math_fields()
        fields = {k: v for k, v in self.flat().items() if k not in skip}
        # fsdp trains the torch backend's model with its loss; only where the state lives differs (as with the
        # number of ranks), and its checkpoints hold the same whole tensors.
        if fields["train_backend"] == "fsdp":
            fields["train_backend"] = "torch"
        return fields

    def math_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.math_fields(), sort_keys=True, default=str).encode()).hexdigest()

    def math_diff(self, saved_math_fields: dict[str, Any]) -> list[str]:
        """`--flag: saved -> now` for every math field that differs from a checkpoint's `math_fields()`."""
        mine = json.loads(json.dumps(self.math_fields(), default=str))
        keys = set(mine) | set(saved_math_fields)
        return sorted(
            f"{flag_name(k)}: {saved_math_fields.get(k)!r} -> {mine.get(k)!r}"
            for k in keys
            if mine.get(k) != saved_math_fields.get(k)
        )
