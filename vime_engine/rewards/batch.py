"""Rewarding a batch (a group's samples) at once: what the rollout worker calls.

A per-sample reward `(response, label) -> float` is applied to each sample in turn; a remote reward sends
the whole batch as one concurrent wave of requests (see `remote.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RewardInput:
    """What a reward sees of one sample."""

    prompt: str
    response: str
    label: str
    sample: Any = None  # the Sample itself, for vime's `(args, sample)` rewards (--custom-rm-path)


BatchRewardFn = Callable[[Sequence[RewardInput]], list[float]]


@dataclass(frozen=True)
class PerSampleReward:
    """A per-sample reward function applied to every sample of a batch."""

    fn: Callable[[str, str], float]  # (response, label) -> reward

    def __call__(self, items: Sequence[RewardInput]) -> list[float]:
        return [float(self.fn(item.response, item.label)) for item in items]
