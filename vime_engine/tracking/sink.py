"""The one sink a run's metrics go to: metrics.jsonl always; TensorBoard, W&B and MLflow when asked."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vime_engine.config import EngineConfig
from vime_engine.tracking.resume import Tracker, run_key


def open_trackers(cfg: EngineConfig) -> list[Tracker]:
    """The trackers `cfg.logging` asks for, each attached to this run's tracker run."""
    lg = cfg.logging
    needs_key = (lg.use_wandb and lg.wandb_run_id is None) or (lg.use_mlflow and lg.mlflow_run_id is None)
    key = run_key(cfg.checkpoint.save) if needs_key else ""
    trackers: list[Tracker] = []
    try:
        if lg.use_wandb:
            from vime_engine.tracking.wandb_tracker import WandbTracker  # imports wandb: only when asked for

            trackers.append(WandbTracker(lg, lg.wandb_run_id or key, cfg.flat()))
        if lg.use_mlflow:
            from vime_engine.tracking.mlflow_tracker import MlflowTracker  # imports mlflow: only when asked for

            trackers.append(MlflowTracker(lg, key, cfg.flat()))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers


class MetricsSink:
    """One sink for a run's metrics: a jsonl line per record always; TensorBoard, W&B and MLflow when asked."""

    def __init__(self, cfg: EngineConfig):
        lg = cfg.logging
        self.dir = Path(lg.output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.tensorboard = None
        if lg.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.dir / "tensorboard"))
        self.trackers = open_trackers(cfg)

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        record = {"rollout_id": rollout_id, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        numbers = _numbers(metrics)
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(key, value, rollout_id)
        for tracker in self.trackers:
            tracker.log(rollout_id, numbers)

    def rewrite(self, history: Iterable[dict[str, Any]]) -> None:
        """Make metrics.jsonl hold exactly `history` (a resumed run drops what came after its checkpoint), and
        send the trackers what they lack of it (see vime_engine/tracking: they keep what they hold). One pass:
        `history` may be read from a file as it goes."""
        tmp = self.path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as f:
            for record in history:
                f.write(json.dumps(record, sort_keys=True) + "\n")
                metrics = _numbers({k: v for k, v in record.items() if k != "rollout_id"})
                for tracker in self.trackers:
                    tracker.log(record["rollout_id"], metrics)
        tmp.replace(self.path)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        for tracker in self.trackers:
            tracker.close()


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
