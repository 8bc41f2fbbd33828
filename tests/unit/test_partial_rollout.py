"""Partial rollout's bookkeeping: a response cut off, continued under newer weights, finished."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from vime_engine.rollout.dynamic_sampling import CarryOver
from vime_engine.rollout.metrics import version_metrics
from vime_engine.rollout.partial import continuation, extend
from vime_engine.sample import Sample, SampleStatus

ABORTED, COMPLETED, TRUNCATED = SampleStatus.ABORTED, SampleStatus.COMPLETED, SampleStatus.TRUNCATED


def _fresh(group=0):
    return Sample(group_index=group, prompt="p", label="l", prompt_tokens=[1, 2, 3], status=ABORTED)


def test_a_fresh_sample_starts_from_its_prompt_with_the_whole_budget():
    assert continuation(_fresh(), max_response_len=8) == ([1, 2, 3], 8)


def test_a_cut_off_sample_continues_from_prompt_plus_response_with_the_rest_of_the_budget():
    cut = extend(_fresh(), [10, 11, 12], [-0.1, -0.2, -0.3], ABORTED, version=4)
    assert cut.version_segments == [(4, 3)] and not cut.finished
    assert continuation(cut, max_response_len=8) == ([1, 2, 3, 10, 11, 12], 5)


def test_continued_under_new_weights_the_response_is_one_sample_with_two_version_segments():
    cut = extend(_fresh(), [10, 11, 12], [-0.1, -0.2, -0.3], ABORTED, version=4)
    done = extend(cut, [13, 14], [-0.4, -0.5], COMPLETED, version=5)
    assert done.prompt_tokens == [1, 2, 3]  # the trainer sees the original prompt, the response whole
    assert done.response_tokens == [10, 11, 12, 13, 14]
    assert done.rollout_log_probs == [-0.1, -0.2, -0.3, -0.4, -0.5]  # each token's log-prob, in place
    assert done.loss_mask == [1] * 5
    assert done.version_segments == [(4, 3), (5, 2)] and done.weight_version == 4
    assert done.status == COMPLETED and done.finished
    assert cut.response_tokens == [10, 11, 12]  # extending returns a new sample


def test_a_segment_under_the_same_weights_extends_the_last_one_and_an_empty_one_adds_nothing():
    cut = extend(_fresh(), [], [], ABORTED, version=2)  # aborted before its first token
    assert cut.version_segments == [] and continuation(cut, 4) == ([1, 2, 3], 4)
    cut = extend(cut, [10], [-0.1], ABORTED, version=3)
    assert extend(cut, [11], [-0.2], TRUNCATED, version=3).version_segments == [(3, 2)]


def test_a_finished_group_after_continuation_keeps_its_early_finisher_and_joins_the_cut_one():
    early = extend(_fresh(), [20, 21], [-1.0, -1.1], COMPLETED, version=0)  # finished before the cut
    cut = extend(_fresh(), [30, 31, 32], [-2.0, -2.1, -2.2], ABORTED, version=0)
    prompt, budget = continuation(cut, max_response_len=4)
    group = [early, extend(cut, [33], [-2.3], TRUNCATED, version=1)]
    assert (prompt, budget) == ([1, 2, 3, 30, 31, 32], 1)
    assert group[1].response_tokens == [30, 31, 32, 33] and group[1].response_length == 4
    assert group[1].rollout_log_probs == [-2.0, -2.1, -2.2, -2.3]
    assert version_metrics(group, policy_version=1) == {
        "rollout/max_staleness": 1.0, "rollout/mixed_version_samples": 1,
    }


def test_nothing_to_continue_is_an_error():
    done = extend(_fresh(), [10], [-0.1], COMPLETED, version=0)
    with pytest.raises(ValueError, match="completed: nothing to continue"):
        continuation(done, 8)
    with pytest.raises(ValueError, match="no response budget left"):
        continuation(extend(_fresh(), [10, 11], [-0.1, -0.2], ABORTED, version=0), 2)
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        extend(_fresh(), [10, 11], [-0.1], ABORTED, version=0)


def test_the_engines_routing_comes_with_the_last_request_and_stays_with_the_sample_in_the_buffer():
    # --use-rollout-routing-replay: a finished request returns the experts of every token it fed the model (its
    # prompt, here the earlier segment, included), [tokens - 1, layers, top_k]; an aborted one returns none.
    cut = extend(_fresh(), [10, 11], [-0.1, -0.2], ABORTED, version=0)
    assert cut.rollout_routed_experts is None
    routing = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2) % 8  # 3 prompt + 2 + 2 tokens, the last none
    done = extend(cut, [12, 13], [-0.3, -0.4], COMPLETED, version=1, routed_experts=routing)
    assert done.rollout_routed_experts is routing and done.total_length - 1 == len(routing)
    # The dynamic-sampling carry-over and the partial-rollout buffer are pickled into the checkpoint's buffer.pkl.
    carry = pickle.loads(pickle.dumps(CarryOver(groups=[[done]], partial=[[cut]])))
    assert np.array_equal(carry.groups[0][0].rollout_routed_experts, routing)
    assert carry.groups[0][0].rollout_routed_experts.dtype == np.uint8
    with pytest.raises(ValueError, match="routed experts for 5 tokens of a sequence of 7: expected 6"):
        extend(cut, [12, 13], [-0.3, -0.4], COMPLETED, version=1, routed_experts=routing[:5])
