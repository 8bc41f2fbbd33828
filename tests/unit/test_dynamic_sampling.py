from __future__ import annotations

import pytest

from vime_engine.rollout.dynamic_sampling import CarryOver, collect_groups, rewards_differ
from vime_engine.sample import Sample


def _group(index, rewards):
    return [Sample(group_index=index, prompt="p", label="l", prompt_tokens=[1], reward=r) for r in rewards]


def test_filters_equal_reward_groups_and_carries_surplus_over():
    rounds = [
        _group(0, [1, 1]) + _group(1, [0, 1]) + _group(2, [0, 0]),
        _group(3, [1, 0]) + _group(4, [0.5, 0]) + _group(5, [0, 1]),
    ]
    carry = CarryOver()
    got = collect_groups(lambda r: rounds[r], wanted=2, keep=rewards_differ, carry=carry)
    assert [g[0].group_index for g in got.groups] == [1, 3]
    assert got.drops == {"all_rewards_equal": 2} and got.rounds == 2
    assert [g[0].group_index for g in carry.groups] == [4, 5]

    # The next rollout is served from the carry-over first, without generating.
    got = collect_groups(lambda r: pytest.fail("should not generate"), wanted=2, keep=rewards_differ, carry=carry)
    assert [g[0].group_index for g in got.groups] == [4, 5] and carry.groups == []


def test_gives_up_with_a_clear_message():
    with pytest.raises(RuntimeError, match="raise --over-sampling-batch-size"):
        collect_groups(lambda r: _group(r, [0, 0]), wanted=1, keep=rewards_differ, carry=CarryOver(), max_rounds=3)
