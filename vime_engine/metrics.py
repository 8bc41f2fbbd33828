"""vime's metrics of a rollout, and the one sink they go to (jsonl, TensorBoard, W&B, MLflow)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vime_engine.config import EngineConfig
from vime_engine.rollout.custom_generate import TOOL_CALLS, model_turns
from vime_engine.sample import Sample, SampleStatus
from vime_engine.tracking import open_trackers


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
        **multi_turn_metrics(samples),
    }


def multi_turn_metrics(samples: list[Sample]) -> dict[str, float]:
    """Where responses hold tool / environment tokens (loss_mask 0), or a generate function counts tool calls:
    the model's own tokens and turns, and the share of samples that called a tool."""
    out: dict[str, float] = {}
    if any(0 in s.loss_mask for s in samples) or any(TOOL_CALLS in s.metadata for s in samples):
        out["rollout/model_tokens/mean"] = statistics.fmean(sum(s.loss_mask) for s in samples)
        out["rollout/model_turns/mean"] = statistics.fmean(model_turns(s.loss_mask) for s in samples)
    if any(TOOL_CALLS in s.metadata for s in samples):
        out["rollout/tool_call_share"] = sum(s.metadata.get(TOOL_CALLS, 0) > 0 for s in samples) / len(samples)
    return out


def version_metrics(samples: list[Sample], policy_version: int) -> dict[str, float]:
    """How far behind the trained policy (`policy_version`) the weights that generated the samples were."""
    return {
        "rollout/max_staleness": float(max(policy_version - s.weight_version for s in samples)),
        "rollout/mixed_version_samples": sum(len(s.version_segments) > 1 for s in samples),
    }


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
