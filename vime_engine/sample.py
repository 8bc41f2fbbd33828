"""The unit of data that flows from the rollout engine to the trainer (DESIGN.md §3)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SampleStatus(str, enum.Enum):
    COMPLETED = "completed"  # the model emitted EOS / a stop string
    TRUNCATED = "truncated"  # hit the response length limit
    ABORTED = "aborted"  # not finished: cut off by the end of a rollout (partial rollout), or not yet started


@dataclass
class Sample:
    """One response to one prompt, with everything the trainer and the metrics need.

    `group_index` ties the n samples drawn for one prompt together (GRPO groups).
    `version_segments` says which weights generated the response: (weight version, number of tokens) in
    generation order. It has one entry unless the response was cut off and continued after a weight update
    (`--partial-rollout`); `rollout_log_probs` are per token, each under the version that sampled it.
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
    version_segments: list[tuple[int, int]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    remove_sample: bool = False  # vime's --rollout-sample-filter-path sets it: the sample then trains no token

    Status = SampleStatus  # vime's plugins compare `sample.status == Sample.Status.COMPLETED`

    @property
    def weight_version(self) -> int:
        """The trainer step whose weights generated the first response token: the oldest, so the staleness."""
        return self.version_segments[0][0]

    @property
    def finished(self) -> bool:
        return self.status != SampleStatus.ABORTED

    @property
    def response_length(self) -> int:
        return len(self.response_tokens)

    @property
    def total_length(self) -> int:
        return len(self.prompt_tokens) + len(self.response_tokens)

    # -- vime's names, read-only, for plugins written against vime's Sample -----------------------------------
    @property
    def tokens(self) -> list[int]:
        """Prompt and response tokens, as vime's `Sample.tokens`."""
        return self.prompt_tokens + self.response_tokens

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask)

    @property
    def weight_versions(self) -> list[str]:
        return [str(version) for version, _ in self.version_segments]

    def get_reward_value(self, args: Any) -> float:
        key = getattr(args, "reward_key", None)
        return self.reward if not key else self.reward[key]
