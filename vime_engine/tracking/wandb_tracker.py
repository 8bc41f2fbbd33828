"""W&B: the run's metrics by vime's names against `rollout_id`, the flat config as the run's config.

Each log call is one history row with the rollout id in it; every metric is charted against `rollout_id`
(`define_metric`), so the baseline evaluation before training sits at -1. W&B's own `_step` only numbers the
rows: it continues across starts of the run (from the transaction logs on this machine, or the resumed
run's `starting_step` online), so no start reuses a step of an earlier one; `wandb sync` uploads an offline
run's directories (one per start) oldest first.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import wandb

from vime_engine.config import LoggingConfig
from vime_engine.tracking.resume import DEFAULT_PROJECT, HeldSteps
from vime_engine.tracking.wandb_log import history_rows, run_logs

log = logging.getLogger(__name__)
X_AXIS = "rollout_id"


class WandbTracker:
    def __init__(self, lg: LoggingConfig, run_id: str, config: dict[str, Any]):
        root = Path(lg.wandb_dir or lg.output_dir)
        root.mkdir(parents=True, exist_ok=True)
        rows = [row for path in run_logs(root, run_id) for row in history_rows(path)]  # before this start adds one
        host = {"base_url": lg.wandb_host} if lg.wandb_host else {}  # else W&B's own (WANDB_BASE_URL, its cloud)
        self.run = wandb.init(
            project=lg.wandb_project or DEFAULT_PROJECT, entity=lg.wandb_team, group=lg.wandb_group, id=run_id,
            resume="allow", mode=lg.wandb_mode, dir=str(root), config=config, allow_val_change=True,
            settings=wandb.Settings(silent=True, console="off", **host),
        )
        self.run.define_metric(X_AXIS)
        self.run.define_metric("*", step_metric=X_AXIS)
        self.held = HeldSteps(held_in_rows(rows))
        if self.run.resumed:  # online, possibly on a machine without the earlier transaction logs
            for key, rollout_id in held_in_summary(dict(self.run.summary)).items():
                self.held.last[key] = max(rollout_id, self.held.last.get(key, rollout_id))
        self.next_step = max([row["_step"] + 1 for row in rows] + [self.run.starting_step])
        log.info("W&B run %s (%s) in %s", run_id, self.run.settings.mode, self.run.settings.sync_dir)

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        fresh = self.held.new(rollout_id, metrics)
        if fresh:
            self.run.log({X_AXIS: rollout_id, **fresh}, step=self.next_step, commit=True)
            self.next_step += 1

    def close(self) -> None:
        self.run.finish()
        # wandb 0.31's `finish` can return while its service still writes the run's transaction log (the log read
        # right after held 7 of its 21,900 bytes in 2 of 10 tries): a start after this one, in this process or
        # another, reads that log for its steps. Tearing the service down waits for it to close its files.
        wandb.teardown()


def held_in_rows(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Per metric, the last rollout id that the history rows hold it at."""
    held: dict[str, int] = {}
    for row in rows:
        rollout_id = row.get(X_AXIS)
        if rollout_id is None:
            continue  # not a row of ours
        for key in row:
            if key != X_AXIS and not key.startswith("_"):
                held[key] = max(rollout_id, held.get(key, rollout_id))
    return held


def held_in_summary(summary: dict[str, Any]) -> dict[str, int]:
    """What a resumed run's summary tells: each metric in it counts as held up to the last row's rollout id
    (rows come in rollout order, so none was logged at a later one)."""
    last = summary.get(X_AXIS)
    if not isinstance(last, int):
        return {}
    return {key: last for key in summary if key != X_AXIS and not key.startswith("_")}
