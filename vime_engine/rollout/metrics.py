"""vime's rollout/* metrics of one rollout's samples."""

from __future__ import annotations

import statistics

from vime_engine.rollout.custom_generate import TOOL_CALLS, model_turns
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
