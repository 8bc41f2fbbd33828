"""The RL driver loop: generate → train → sync weights → log, one rollout at a time."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from vime_engine.config import EngineConfig
from vime_engine.data.datasets import load_prompt_dataset
from vime_engine.data.source import DataSource
from vime_engine.metrics import MetricsSink, rollout_metrics
from vime_engine.rollout.worker import train_plan
from vime_engine.runtime.cluster import ray_cluster
from vime_engine.runtime.devices import resolve_accelerator
from vime_engine.runtime.workers import Workers

RolloutCallback = Callable[[int, dict[str, Any]], None]


@dataclass
class RunResult:
    rollouts_done: list[int] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)


def train(cfg: EngineConfig, on_rollout: RolloutCallback | None = None) -> RunResult:
    """Run rollouts 0 … num_rollout-1 on a Ray cluster and return the per-rollout metrics."""
    accel = resolve_accelerator(cfg.placement.device)
    d, r = cfg.data, cfg.rollout
    data = DataSource(load_prompt_dataset(d.prompt_data, d.input_key, d.label_key, d.metadata_key),
                      shuffle=d.rollout_shuffle, seed=d.rollout_seed)
    sink = MetricsSink(cfg.logging.output_dir, cfg.logging.use_tensorboard, cfg.logging.use_wandb)
    plan = train_plan(cfg)
    result = RunResult()
    with ray_cluster(cfg.placement.ray_address):
        workers = Workers(cfg, accel)
        version = 0
        workers.sync_weights(version)  # the engine starts from the trainer's weights, whatever loaded them

        def start_generation(rollout_id: int):
            return time.perf_counter(), workers.generate(
                data.next_batch(r.rollout_batch_size), rollout_id, rollout_id * r.rollout_batch_size, plan
            )

        pending = start_generation(0) if r.num_rollout else None
        for rollout_id in range(r.num_rollout):
            started, future = pending
            samples = ray.get(future)
            rollout_time = time.perf_counter() - started
            last = rollout_id + 1 == r.num_rollout
            if cfg.placement.async_rollout and not last:
                pending = start_generation(rollout_id + 1)  # overlaps training; one step off-policy

            t0 = time.perf_counter()
            train_metrics = workers.train(samples)
            t1 = time.perf_counter()
            version += 1
            workers.sync_weights(version)
            sync_time = time.perf_counter() - t1

            if not cfg.placement.async_rollout and not last:
                pending = start_generation(rollout_id + 1)
            metrics = {
                **rollout_metrics(samples),
                **train_metrics,
                "perf/rollout_time": rollout_time,
                "perf/train_time": t1 - t0,
                "perf/update_weights_time": sync_time,
                "perf/tokens_per_sec": sum(s.response_length for s in samples) / rollout_time,
                "weight_version": version,
            }
            sink.log(rollout_id, metrics)
            result.rollouts_done.append(rollout_id)
            result.history.append({"rollout_id": rollout_id, **metrics})
            if on_rollout is not None:
                on_rollout(rollout_id, metrics)
    sink.close()
    return result
