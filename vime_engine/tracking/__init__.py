"""Experiment trackers (W&B, MLflow) that the metrics sink fans out to, and the resume rule they share.

One vime run is one tracker run, found again when the run resumes: by `--wandb-run-id` / `--mlflow-run-id`,
else by a key kept in the `--save` directory (`tracking-run-key`), so a run restarted with the same `--save`
continues its tracker runs and a fresh directory starts new ones. Without `--save` nothing can resume and
each start is a new tracker run.

Resume rule: a tracker is sent a metric at a rollout id only if its run does not yet hold that metric at
that rollout id or a later one, as read from the tracker's own store when it opens (MLflow: the run's metric
history; W&B: its transaction logs under --wandb-dir, or the resumed run's summary). A run killed after
logging rollout 5 and resumed from its checkpoint at 3 therefore sends nothing again for 4 and 5: the tracker
keeps the values logged first, which the resumed run reproduces (bit-identical on CPU, without a jump on
accelerators). What a tracker lacks of the checkpoint's history (W&B writes its log every 15 s, so a kill
loses the last seconds; or the tracker was switched on at resume) is sent when the sink is rewritten to that
history. Each tracker thus holds every rollout id once.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from vime_engine.config import EngineConfig

log = logging.getLogger(__name__)
RUN_KEY_FILE = "tracking-run-key"
DEFAULT_PROJECT = "vimeflow"  # the W&B project and the MLflow experiment when none is given


class Tracker(Protocol):
    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        """Send the metrics of `rollout_id` that the tracker's run does not hold yet."""

    def close(self) -> None: ...


class HeldSteps:
    """Per metric name, the last rollout id a tracker's run holds; passes on only what is new to it."""

    def __init__(self, last: dict[str, int] | None = None):
        self.last: dict[str, int] = dict(last or {})

    def new(self, rollout_id: int, metrics: dict[str, float]) -> dict[str, float]:
        fresh = {k: v for k, v in metrics.items() if k not in self.last or rollout_id > self.last[k]}
        self.last.update(dict.fromkeys(fresh, rollout_id))
        return fresh


def run_key(save_dir: str | None) -> str:
    """The key the tracker runs of this run are found by: kept in `save_dir`, made on first use."""
    if save_dir is None:
        return uuid.uuid4().hex[:16]
    path = Path(save_dir) / RUN_KEY_FILE
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = uuid.uuid4().hex[:16]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(key)
    tmp.replace(path)
    return key


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
