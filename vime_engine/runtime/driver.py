"""The RL driver loop: generate → train → sync weights → log → eval → save, one rollout at a time.

The loop owns no math; it sequences the workers and keeps the state that a checkpoint must carry
(see `RunState`). Everything that sets up or tears down a run lives in `runtime/run_state.py`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vime_engine.checkpoint.finite import stop_if_diverged
from vime_engine.checkpoint.lock import exclusive_writer
from vime_engine.config import EngineConfig
from vime_engine.plugins.boundary import user_functions_in
from vime_engine.rollout.metrics import rollout_metrics, version_metrics
from vime_engine.preflight import check_datasets, check_inputs, check_on_device
from vime_engine.rollout.dynamic_sampling import collect_groups
from vime_engine.runtime.cluster import ray_cluster
from vime_engine.devices.accelerator import Accelerator, resolve_accelerator
from vime_engine.runtime.placement import with_placement_decided
from vime_engine.runtime.preemption import Preempted, PreemptionGuard
from vime_engine.runtime.run_state import RunContext, run_evaluations
from vime_engine.runtime.workers import Workers

RolloutCallback = Callable[[int, dict[str, Any]], None]


@dataclass
class RunResult:
    rollouts_done: list[int] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: Any = None  # CheckpointRef of the last save, if any
    eval_metrics: dict[str, float] = field(default_factory=dict)


def local_cluster_cpus(cfg: EngineConfig) -> int:
    """Ray CPUs of a private local cluster: one per trainer rank and per engine device (colocated: the engine is in
    the trainer's actor), at least the machine's."""
    colocated = cfg.placement.colocate is True
    rollout_devices = 0 if colocated else cfg.rollout_engines * cfg.rollout.rollout_num_gpus_per_engine
    return max(4, os.cpu_count() or 1, cfg.trainer_world_size + rollout_devices)


def train(cfg: EngineConfig, end_rollout_id: int | None = None, on_rollout: RolloutCallback | None = None,
          say_stopped: Callable[[str], None] | None = None) -> RunResult:
    """Run rollouts from the resume point (or 0) up to `end_rollout_id` (default `--num-rollout`). `say_stopped`
    shows why a second Ctrl-C ended the run at once (default: the log), just before the process exits."""
    end = cfg.rollout.num_rollout if end_rollout_id is None else end_rollout_id
    save = cfg.checkpoint.save
    # SIGTERM and Ctrl-C stop the run at its next safe point, start-up included (runtime/preemption.py)
    with PreemptionGuard(save, say_stopped) as preemption:
        check_inputs(cfg)  # model, checkpoints and plugins, before Ray starts
        preemption.stop_if_requested()
        accel = resolve_accelerator(cfg.placement.device)
        check_on_device(cfg, accel.kind)
        cfg = with_placement_decided(cfg, accel.kind)
        with (exclusive_writer(save) if save is not None else contextlib.nullcontext(),  # one run per --save
              ThreadPoolExecutor(1, thread_name_prefix="preflight") as background):
            datasets_checked = background.submit(check_datasets, cfg)  # every data row, while Ray starts
            with ray_cluster(cfg.placement.ray_address, num_cpus=local_cluster_cpus(cfg)):
                datasets_checked.result()  # a bad row is refused before any worker starts
                preemption.stop_if_requested()
                return _rollout_loop(cfg, accel, end, on_rollout, preemption)


def _rollout_loop(cfg: EngineConfig, accel: Accelerator, end: int, on_rollout: RolloutCallback | None,
                  preemption: PreemptionGuard) -> RunResult:
    with Workers(cfg, accel) as workers:
        ctx = RunContext.open(cfg, workers)
        state, result = ctx.state, RunResult()
        workers.sync_weights(state.weight_version)  # the engine serves the trainer's (possibly resumed) weights
        if state.next_rollout_id == 0 and cfg.eval_datasets:
            ctx.log_eval(-1, run_evaluations(cfg, workers, rollout_id=-1))  # the baseline before training
        preemption.stop_if_requested()  # the end of start-up

        for rollout_id in range(state.next_rollout_id, end):
            preemption.phase = f"rollout {rollout_id}"
            with user_functions_in(f"rollout {rollout_id}"):  # a user function's error names the rollout
                t0 = time.perf_counter()
                collected = collect_groups(
                    lambda round_, resumed: ctx.start_round(rollout_id, round_, resumed),
                    cfg.rollout.rollout_batch_size, ctx.group_filter, state.carry,
                    take_buffered=ctx.hooks.take_buffered, draw_size=ctx.draw_size,
                )
                ctx.hooks.after_collect(collected.groups, collected.seen, ctx.data)
                samples = collected.samples
                if cfg.placement.async_rollout and rollout_id + 1 < end:
                    ctx.prefetch(rollout_id + 1)  # generation of the next rollout overlaps this training step
                t1 = time.perf_counter()
                train_metrics = workers.train(samples)
                stop_if_diverged(rollout_id, train_metrics)  # before the step reaches the engines or a checkpoint
                t2 = time.perf_counter()
                state.weight_version += 1
                workers.sync_weights(state.weight_version)
                t3 = time.perf_counter()

                metrics = {
                    **rollout_metrics(samples),
                    **version_metrics(samples, state.weight_version - 1),  # the version just trained from
                    **collected.metrics(),
                    **train_metrics,
                    **workers.rollout.recovery_metrics(),
                    "perf/rollout_time": t1 - t0,
                    "perf/train_time": t2 - t1,
                    "perf/update_weights_time": t3 - t2,
                    "perf/tokens_per_sec": sum(s.response_length for s in samples) / (t1 - t0),
                    "weight_version": state.weight_version,
                }
                if ctx.eval_due(rollout_id):
                    metrics.update(run_evaluations(cfg, workers, rollout_id))
                ctx.log_rollout(rollout_id, metrics,
                                write=not ctx.hooks.skip_default_log(rollout_id, samples, collected.metrics(), t1 - t0))
                result.rollouts_done.append(rollout_id)
                if on_rollout is not None:
                    on_rollout(rollout_id, metrics)
                if ctx.save_due(rollout_id, end) or preemption.requested:
                    result.checkpoint = ctx.save(rollout_id)
                if preemption.requested:
                    raise Preempted(rollout_id, result.checkpoint, preemption.requested)

        if cfg.rollout.num_rollout == 0 and cfg.eval_datasets:  # eval-only run on the loaded weights
            result.eval_metrics = run_evaluations(cfg, workers, rollout_id=state.next_rollout_id - 1)
            ctx.log_eval(state.next_rollout_id - 1, result.eval_metrics)
        if cfg.checkpoint.save_hf:
            workers.trainer.save_hf(cfg.checkpoint.save_hf)
        result.history = list(state.history)
        ctx.close()
    return result
