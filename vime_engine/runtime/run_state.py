"""What the driver loop keeps between rollouts, and how it is saved, restored and evaluated."""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vime_engine.checkpoint import store as ckpt
from vime_engine.config import ConfigError, EngineConfig
from vime_engine.data.prompt_length import load_prompts
from vime_engine.data.records import PromptRecord
from vime_engine.data.source import DataSource
from vime_engine.rollout.evaluation import summarize, write_results
from vime_engine.checkpoint.finite import NonFiniteCheckpoint
from vime_engine.checkpoint.manifest import ChecksumMismatch
from vime_engine.tracking.sink import MetricsSink
from vime_engine.rollout.dynamic_sampling import CarryOver, FinishedRound, GroupFilter, RoundStream
from vime_engine.rollout.vllm_engine import SamplingSettings
from vime_engine.rollout.worker import GenerationPlan, train_plan
from vime_engine.checkpoint.run_history import HISTORY_FILE, MARK_KEY, HistoryError, HistoryMark, RunHistory, read_checked
from vime_engine.runtime.workers import Workers
from vime_engine.sample import Sample
from vime_engine.rollout.vime_hooks import load_rollout_hooks

log = logging.getLogger(__name__)
BUFFER_FILE = "buffer.pkl"


@dataclass
class RunState:
    """Everything besides the trainer's own state that a resumed run needs to continue identically."""

    next_rollout_id: int = 0
    weight_version: int = 0
    groups_drawn: int = 0  # numbers prompt groups across the run; their sampling seeds derive from it
    carry: CarryOver = field(default_factory=CarryOver)
    history: RunHistory = field(default_factory=RunHistory)  # in memory: the records since the last save


class RunContext:
    def __init__(self, cfg: EngineConfig, workers: Workers, data: DataSource, sink: MetricsSink, state: RunState):
        self.cfg, self.workers, self.data, self.sink, self.state = cfg, workers, data, sink, state
        self.plan = train_plan(cfg)
        self.draw_size = cfg.rollout.over_sampling_batch_size or cfg.rollout.rollout_batch_size
        self.hooks = load_rollout_hooks(cfg)  # vime's plugin hooks; without them, what the engine does anyway
        self.group_filter: GroupFilter = self.hooks.keep
        self._prefetched: tuple[int, Any] | None = None
        self._cursor_before_prefetch: tuple[dict, int] | None = None

    @classmethod
    def open(cls, cfg: EngineConfig, workers: Workers) -> RunContext:
        d = cfg.data
        data = DataSource(load_prompts(cfg, d.prompt_data, d.input_key, d.label_key, d.metadata_key),
                          shuffle=d.rollout_shuffle, seed=d.rollout_seed)
        sink = MetricsSink(cfg)
        state, saved_history = RunState(), b""
        # The sha256 of each file is checked as it is loaded; a corrupt newest checkpoint (or one holding NaN, saved
        # before saves refused them) falls back to the next.
        for found in ckpt.candidates(cfg.checkpoint.load or cfg.checkpoint.save):
            try:
                state, saved_history = _restore(cfg, found, workers, data)
            except ckpt.CheckpointError as exc:
                log.warning("skipping checkpoint %s: %s", found.path.name, exc)
                continue
            log.info("resuming from %s at rollout %d", found.path, state.next_rollout_id)
            break
        if cfg.checkpoint.start_rollout_id is not None:
            state.next_rollout_id = cfg.checkpoint.start_rollout_id
        # Both drop what an interrupted run logged after the checkpoint.
        state.history = RunHistory.start(cfg.checkpoint.save, saved_history)
        sink.rewrite(state.history)
        return cls(cfg, workers, data, sink, state)

    # -- generation ---------------------------------------------------------------------------------------------
    def _draw(self, resumed: int) -> tuple[list[PromptRecord], int]:
        """Fresh prompts to fill a round of `draw_size` groups beside `resumed` partial ones; the first's number."""
        records = self.data.next_batch(self.draw_size - resumed) if resumed < self.draw_size else []
        first_group = self.state.groups_drawn
        self.state.groups_drawn += len(records)
        return records, first_group

    def prefetch(self, rollout_id: int) -> None:
        """Start the first generation round of `rollout_id` now (async mode), remembering the cursor before it."""
        self._cursor_before_prefetch = (self.data.state_dict(), self.state.groups_drawn)
        records, first_group = self._draw(0)
        self._prefetched = (rollout_id, self.workers.generate(records, rollout_id, first_group, self.plan))

    def start_round(self, rollout_id: int, round_: int, resumed: list[list[Sample]]) -> RoundStream:
        """The next round of `rollout_id`: watched as it runs with --partial-rollout, else generated whole."""
        if round_ == 0 and self._prefetched is not None and self._prefetched[0] == rollout_id:
            future, self._prefetched, self._cursor_before_prefetch = self._prefetched[1], None, None
            return FinishedRound(future.result())
        records, first_group = self._draw(len(resumed))
        if self.cfg.rollout.partial_rollout:
            return self.workers.stream(records, resumed, rollout_id, first_group, self.plan)
        return FinishedRound(self.workers.generate(records, rollout_id, first_group, self.plan).result())

    # -- bookkeeping --------------------------------------------------------------------------------------------
    def log_rollout(self, rollout_id: int, metrics: dict[str, Any], write: bool = True) -> None:
        """Keep the rollout's metrics in the run's history; `write`: also to the sinks (a vime log function may
        have logged them its own way)."""
        self.state.history.append({"rollout_id": rollout_id, **metrics})
        self.state.next_rollout_id = rollout_id + 1
        if write:
            self.sink.log(rollout_id, metrics)

    def log_eval(self, rollout_id: int, metrics: dict[str, float]) -> None:
        self.state.history.append({"rollout_id": rollout_id, **metrics})
        self.sink.log(rollout_id, metrics)

    def eval_due(self, rollout_id: int) -> bool:
        interval = self.cfg.eval.eval_interval
        if not self.cfg.eval_datasets:
            return False
        return rollout_id + 1 == self.cfg.rollout.num_rollout or bool(interval and (rollout_id + 1) % interval == 0)

    def save_due(self, rollout_id: int, end: int) -> bool:
        c = self.cfg.checkpoint
        if c.save is None:
            return False
        return rollout_id + 1 == end or bool(c.save_interval and (rollout_id + 1) % c.save_interval == 0)

    def save(self, rollout_id: int) -> ckpt.CheckpointRef:
        root = Path(self.cfg.checkpoint.save)
        staged = ckpt.staging_dir(root, rollout_id)
        written = self.workers.trainer.save_state(str(staged))
        with open(staged / BUFFER_FILE, "wb") as f:
            pickle.dump(self.state.carry, f)
        cursor, groups_drawn = self._cursor_before_prefetch or (self.data.state_dict(), self.state.groups_drawn)
        driver_state = {
            "rollout_id": rollout_id,
            "weight_version": self.state.weight_version,
            "groups_drawn": groups_drawn,
            "data_cursor": cursor,
            MARK_KEY: self.state.history.persist().to_json(),  # before the manifest: the save points at them
            "config": self.cfg.flat(),
            "math_fields": self.cfg.math_fields(),
            "config_hash": self.cfg.math_hash(),
        }
        ref = ckpt.commit(root, staged, rollout_id, _json_safe(driver_state), self.cfg.checkpoint.keep_last, written)
        log.info("saved %s", ref.path)
        return ref

    def close(self) -> None:
        self.sink.close()


def _restore(cfg: EngineConfig, found: ckpt.CheckpointRef, workers: Workers,
             data: DataSource) -> tuple[RunState, list[dict[str, Any]] | bytes]:
    """The run state saved in `found` and its history so far (checked file prefix, or an old checkpoint's list)."""
    saved = found.driver_state()
    diff = cfg.math_diff(saved["math_fields"])
    if diff:
        raise ConfigError(
            f"checkpoint {found.path} was trained with other settings that change the math:\n  "
            + "\n  ".join(diff)
            + "\nuse the checkpoint's values, or start a fresh run with another --save directory"
        )
    history = _saved_history(found, saved)
    carry = pickle.loads(found.read_verified(BUFFER_FILE))
    try:
        workers.trainer.load_state(str(found.path), found.manifest.files)
    except (ChecksumMismatch, NonFiniteCheckpoint) as exc:  # raised in a trainer rank: Ray's error wraps it as `cause`
        raise ckpt.CheckpointError(str(getattr(exc, "cause", exc))) from None
    data.load_state_dict(saved["data_cursor"])
    state = RunState(next_rollout_id=saved["rollout_id"] + 1, weight_version=saved["weight_version"],
                     groups_drawn=saved["groups_drawn"], carry=carry)
    return state, history


def _saved_history(found: ckpt.CheckpointRef, saved: dict[str, Any]) -> list[dict[str, Any]] | bytes:
    if MARK_KEY not in saved:  # written before the history file existed: driver.json holds the whole list
        return list(saved["history"])
    try:
        return read_checked(found.path.parent / HISTORY_FILE, HistoryMark.from_json(saved[MARK_KEY]))
    except HistoryError as exc:
        raise ckpt.CheckpointError(f"{found.path}: {exc}") from None


def _json_safe(value: Any) -> Any:
    import json

    return json.loads(json.dumps(value, default=str))


def run_evaluations(cfg: EngineConfig, workers: Workers, rollout_id: int) -> dict[str, float]:
    """Every `--eval-prompt-data` set on the engine's current weights; writes per-problem results files."""
    e, r = cfg.eval, cfg.rollout
    plan = lambda name: GenerationPlan(  # noqa: E731
        SamplingSettings(
            e.eval_max_response_len or r.rollout_max_response_len,
            e.eval_temperature if e.eval_temperature is not None else r.rollout_temperature,
            e.eval_top_p if e.eval_top_p is not None else r.rollout_top_p,
            e.eval_top_k if e.eval_top_k is not None else r.rollout_top_k,
        ),
        e.n_samples_per_eval_prompt, f"eval/{name}", e.eval_rm_type,
    )
    metrics: dict[str, float] = {}
    for name, path in cfg.eval_datasets:
        records = load_prompts(cfg, path, e.eval_input_key or cfg.data.input_key,
                               e.eval_label_key or cfg.data.label_key)
        samples = workers.generate(records, max(rollout_id, 0), 0, plan(name)).result()
        values, rows = summarize(name, samples, e.n_samples_per_eval_prompt)
        write_results(Path(cfg.logging.output_dir) / "eval" / f"{name}_rollout_{rollout_id + 1:07d}.jsonl", rows)
        metrics.update(values)
    return metrics
