"""The unit of data that flows from the rollout engine to the trainer (DESIGN.md §3)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SampleStatus(str, enum.Enum):
    COMPLETED = "completed"  # the model emitted EOS / a stop string
    TRUNCATED = "truncated"  # hit the response length limit
    ABORTED = "aborted"  # cut off by the end of a rollout (partial rollout); resumable


@dataclass
class Sample:
    """One response to one prompt, with everything the trainer and the metrics need.

    `group_index` ties the n samples drawn for one prompt together (GRPO groups);
    `weight_version` is the trainer step whose weights generated the response.
    """

    group_index: int
    prompt: str
    label: str
    prompt_tokens: list[int]
    response_tokens: list[int] = field(default_factory=list)
    response: str = ""
    rollout_log_probs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    status: SampleStatus = SampleStatus.COMPLETED
    weight_version: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    @property
    def total_length(self) -> int:
        return len(self.prompt_tokens) + len(self.response_tokens)
