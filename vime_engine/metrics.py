"""One metrics sink: a jsonl line per rollout always, TensorBoard (and wandb) when asked."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from vime_engine.sample import Sample, SampleStatus


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    """vime's rollout/* metrics of one rollout's samples."""
    lengths = [s.response_length for s in samples]
    rewards = [s.reward for s in samples]
    return {
        "rollout/raw_reward": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/response_len/mean": statistics.fmean(lengths),
        "rollout/response_len/max": float(max(lengths)),
        "rollout/response_len/min": float(min(lengths)),
        "rollout/truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
    }


def version_metrics(samples: list[Sample], policy_version: int) -> dict[str, float]:
    """How far behind the trained policy (`policy_version`) the weights that generated the samples were."""
    return {
        "rollout/max_staleness": float(max(policy_version - s.weight_version for s in samples)),
        "rollout/mixed_version_samples": sum(len(s.version_segments) > 1 for s in samples),
    }


class MetricsSink:
    def __init__(self, output_dir: str | Path, use_tensorboard: bool = False, use_wandb: bool = False):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.tensorboard = None
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.dir / "tensorboard"))
        self.wandb = None
        if use_wandb:
            import wandb  # optional: only when asked for

            self.wandb = wandb

    def log(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        record = {"rollout_id": rollout_id, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                if self.tensorboard is not None:
                    self.tensorboard.add_scalar(key, value, rollout_id)
        if self.wandb is not None:
            self.wandb.log(record, step=rollout_id)

    def rewrite(self, history: list[dict[str, Any]]) -> None:
        """Make metrics.jsonl hold exactly `history` (a resumed run drops what came after its checkpoint)."""
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(record, sort_keys=True) + "\n" for record in history))
        tmp.replace(self.path)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
