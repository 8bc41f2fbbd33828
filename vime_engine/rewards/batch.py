"""Rewarding a batch (a group's samples) at once: what the rollout worker calls.

A per-sample reward `(response, label) -> float` is applied to each sample in turn; a remote reward sends
the whole batch as one concurrent wave of requests (see `remote.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vime_engine.rewards.custom import RewardFn


@dataclass(frozen=True)
class RewardInput:
    """What a reward sees of one sample."""

    prompt: str
    response: str
    label: str


BatchRewardFn = Callable[[Sequence[RewardInput]], list[float]]


@dataclass(frozen=True)
class PerSampleReward:
    """A per-sample reward function applied to every sample of a batch."""

    fn: RewardFn

    def __call__(self, items: Sequence[RewardInput]) -> list[float]:
        return [float(self.fn(item.response, item.label)) for item in items]
