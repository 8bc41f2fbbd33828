from __future__ import annotations

import pytest

from vime_engine.rollout.dynamic_sampling import CarryOver, FinishedRound, collect_groups, rewards_differ
from vime_engine.sample import Sample, SampleStatus


def _group(index, rewards, status=SampleStatus.COMPLETED):
    return [Sample(group_index=index, prompt="p", label="l", prompt_tokens=[1], reward=r, status=status)
            for r in rewards]


def test_filters_equal_reward_groups_and_carries_surplus_over():
    rounds = [
        _group(0, [1, 1]) + _group(1, [0, 1]) + _group(2, [0, 0]),
        _group(3, [1, 0]) + _group(4, [0.5, 0]) + _group(5, [0, 1]),
    ]
    carry = CarryOver()
    got = collect_groups(lambda r, resumed: FinishedRound(rounds[r]), wanted=2, keep=rewards_differ, carry=carry)
    assert [g[0].group_index for g in got.groups] == [1, 3]
    assert got.drops == {"all_rewards_equal": 2} and got.rounds == 2
    assert [g[0].group_index for g in carry.groups] == [4, 5] and carry.partial == []

    # The next rollout is served from the carry-over first, without generating.
    got = collect_groups(lambda r, resumed: pytest.fail("should not generate"), wanted=2, keep=rewards_differ,
                         carry=carry)
    assert [g[0].group_index for g in got.groups] == [4, 5] and carry.groups == []


def test_gives_up_with_a_clear_message():
    with pytest.raises(RuntimeError, match="raise --over-sampling-batch-size"):
        collect_groups(lambda r, resumed: FinishedRound(_group(r, [0, 0])), wanted=1, keep=rewards_differ,
                       carry=CarryOver(), max_rounds=3)


class ScriptedRound:
    """A streaming round: hands out `finishing` one step at a time; what is left when aborted is cut off."""

    def __init__(self, finishing, unfinished):
        self.finishing, self.unfinished = list(finishing), unfinished

    def advance(self):
        return [self.finishing.pop(0)] if self.finishing else []

    def abort(self):
        return self.unfinished + self.finishing


def test_partial_round_is_cut_off_when_the_batch_is_full_and_continued_first_next_time():
    cut = _group(7, [0], SampleStatus.ABORTED)
    started = []

    def start(round_, resumed):
        started.append((round_, [g[0].group_index for g in resumed]))
        return ScriptedRound([_group(4, [1, 1]), _group(5, [0, 1]), _group(6, [1, 0]), _group(8, [0, 1])],
                             [cut])

    carry = CarryOver()
    got = collect_groups(start, wanted=2, keep=rewards_differ, carry=carry)
    assert [g[0].group_index for g in got.groups] == [5, 6]
    assert (got.drops, got.resumed, got.aborted) == ({"all_rewards_equal": 1}, 0, 2)
    # The abort took the group still generating and the one never handed out; nothing surplus was kept.
    assert [g[0].group_index for g in carry.partial] == [7, 8] and carry.groups == []

    got = collect_groups(start, wanted=2, keep=rewards_differ, carry=carry)
    assert started[1] == (0, [7, 8])  # the next rollout's first round continues the cut-off groups
    assert (got.resumed, got.aborted) == (2, 2)
    assert got.metrics() == {"rollout/resumed_groups": 2, "rollout/aborted_groups": 2,
                             "rollout/dropped_groups/all_rewards_equal": 1}
