"""Continuing a response across generation requests: the pure bookkeeping of partial rollout.

A response is generated in one or more segments. A sample that is not finished (status ABORTED: cut off
when its rollout's batch filled up, or not started yet) is generated further from its prompt plus the
response so far, with what is left of the response-length budget; each segment appends its tokens, their
log-probs and the weight version that sampled them. Because the model sees the same token prefix either way,
a response generated in several segments is trained exactly like one generated in one: per token, the
trainer's log-prob against the log-prob of the weights that sampled that token (`--use-tis`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from vime_engine.sample import Sample, SampleStatus

if TYPE_CHECKING:
    import numpy as np


def continuation(sample: Sample, max_response_len: int) -> tuple[list[int], int]:
    """The prompt to generate `sample` further from, and how many tokens it may still add."""
    if sample.finished:
        raise ValueError(f"sample of group {sample.group_index} is {sample.status.value}: nothing to continue")
    budget = max_response_len - sample.response_length
    if budget <= 0:  # a response that reaches the limit finishes as truncated in the same engine step
        raise ValueError(f"sample of group {sample.group_index} has no response budget left ({max_response_len})")
    return sample.prompt_tokens + sample.response_tokens, budget


def extend(sample: Sample, tokens: list[int], log_probs: list[float], status: SampleStatus, version: int,
           routed_experts: np.ndarray | None = None) -> Sample:
    """`sample` with one more generated segment appended; `status` is where that segment ended.

    `routed_experts`: the segment's request's routing (--use-rollout-routing-replay, a finished request), which
    covers the whole sequence but its new last token, the earlier segments' tokens included (fed as its prompt):
    it replaces the sample's. An aborted request returns none, and the sample keeps what it had."""
    if len(tokens) != len(log_probs):
        raise ValueError(f"{len(tokens)} tokens but {len(log_probs)} log-probs")
    total = sample.total_length + len(tokens)
    if routed_experts is not None and len(routed_experts) != total - 1:
        raise ValueError(f"routed experts for {len(routed_experts)} tokens of a sequence of {total}: expected "
                         f"{total - 1} (every token but the last)")
    segments = list(sample.version_segments)
    if tokens and segments and segments[-1][0] == version:
        segments[-1] = (version, segments[-1][1] + len(tokens))
    elif tokens:
        segments.append((version, len(tokens)))
    return replace(
        sample,
        response_tokens=sample.response_tokens + tokens,
        rollout_log_probs=sample.rollout_log_probs + log_probs,
        loss_mask=sample.loss_mask + [1] * len(tokens),
        status=status,
        version_segments=segments,
        rollout_routed_experts=sample.rollout_routed_experts if routed_experts is None else routed_experts,
    )
