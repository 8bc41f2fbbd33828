"""The unit of data that flows from the rollout engine to the trainer: one prompt and its response, with what
training needs of it (tokens, rollout log-probs, loss mask, reward, status, weight versions)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


class SampleStatus(str, enum.Enum):
    COMPLETED = "completed"  # the model emitted EOS / a stop string
    TRUNCATED = "truncated"  # hit the response length limit
    ABORTED = "aborted"  # not finished: cut off by the end of a rollout (partial rollout), or not yet started


# The rollout log-prob stored for a tool / environment token: finite, since a masked NaN would still poison the
# masked sums (NaN * 0 is NaN); loss_mask 0 keeps it out of every loss and metric.
ENVIRONMENT_LOG_PROB = 0.0


@dataclass
class Sample:
    """One response to one prompt, with everything the trainer and the metrics need.

    `group_index` ties the n samples drawn for one prompt together (GRPO groups).
    `version_segments` says which weights generated the response: (weight version, number of tokens) in
    generation order. It has one entry unless the response was cut off and continued after a weight update
    (`--partial-rollout`); `rollout_log_probs` are per token, each under the version that sampled it.

    Multi-turn (`--custom-generate-function-path`): the response interleaves the model's turns (loss_mask 1, with
    their log-probs) and tool / environment replies (loss_mask 0, log-prob `ENVIRONMENT_LOG_PROB`, never compared
    nor trained); `version_segments` then counts the model's tokens only.

    `rollout_routed_experts` (a mixture-of-experts model under `--use-rollout-routing-replay`; vime's name): the
    experts the engine routed each token to, an integer array [len(tokens) - 1, num_hidden_layers, top_k], the
    routing record of vime_engine/train/routing_replay.py; None when the engine was not asked for it.
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
    # Left out of ==: an array's == is elementwise, which a dataclass's == cannot fold into one bool.
    rollout_routed_experts: np.ndarray | None = field(default=None, compare=False)

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

    def append_response_tokens(self, args: Any = None, *, tokens: list[int], log_probs: list[float] | None = None,
                               trainable: bool = True, meta_info: dict[str, Any] | None = None) -> None:
        """Append one turn, as vime's method does: the model's tokens (`trainable`, with their log-probs and the
        generation's `meta_info`, whose `weight_version` is recorded) or a tool reply (not trainable, no log-probs)."""
        del args  # vime's signature; nothing here depends on the run's flags
        tokens = list(tokens)
        if trainable:
            if log_probs is None or len(log_probs) != len(tokens):
                raise ValueError(f"the model's {len(tokens)} tokens need as many rollout log-probs")
            if meta_info is None or "weight_version" not in meta_info:
                raise ValueError("the model's tokens need the generation's meta_info (its weight_version)")
            version = int(meta_info["weight_version"])
            if tokens and self.version_segments and self.version_segments[-1][0] == version:
                self.version_segments[-1] = (version, self.version_segments[-1][1] + len(tokens))
            elif tokens:
                self.version_segments.append((version, len(tokens)))
        elif log_probs is not None:
            raise ValueError("tool / environment tokens take no log-probs: they were not sampled by the model")
        self.response_tokens = self.response_tokens + tokens
        self.rollout_log_probs = self.rollout_log_probs + (
            [float(x) for x in log_probs] if trainable else [ENVIRONMENT_LOG_PROB] * len(tokens))
        self.loss_mask = self.loss_mask + [int(trainable)] * len(tokens)
