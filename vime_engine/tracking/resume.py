"""What a tracker holds already, and the key a run's tracker runs are found by (the rule: vime_engine/tracking)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Protocol

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
