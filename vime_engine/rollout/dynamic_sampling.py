"""Dynamic sampling: over-sample prompts, keep only groups that carry a learning signal.

With `--over-sampling-batch-size M`, prompts are drawn M at a time; each group (the n samples of one prompt)
passes through the filter (`--dynamic-sampling-filter-path`, default: rewards not all equal, since a group
of equal rewards has zero GRPO advantage). Kept groups fill the rollout batch; kept groups beyond it are
carried over to the next rollout, and that carry-over is part of the checkpoint.

With `--partial-rollout` a round is watched as it generates: groups are filtered as they finish, and once the
batch is full the groups still generating are aborted and carried over as they stand (tokens and log-probs so
far). The next rollout's first round continues them before drawing new prompts. The filter runs here, in the
driver, once per finished group; the engine's step loop is deterministic, so where the cut falls is too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from vime_engine.plugins import load_function
from vime_engine.sample import Sample

GroupFilter = Callable[[list[Sample]], bool]


def rewards_differ(group: list[Sample]) -> bool:
    """Keep a group unless all its rewards are equal (zero advantage for every sample)."""
    return len({s.reward for s in group}) > 1


def load_group_filter(spec: str | None) -> GroupFilter:
    if spec is None:
        return rewards_differ
    return load_function(spec, "--dynamic-sampling-filter-path", ("group",), "`(group: list[Sample]) -> bool`")


def group_samples(samples: list[Sample]) -> list[list[Sample]]:
    """Samples → groups, in order of first appearance (generation keeps each group contiguous)."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


@dataclass
class CarryOver:
    """What a rollout leaves for the next; saved with the checkpoint.

    `groups`: kept, finished groups beyond the batch. `partial`: groups cut off by `--partial-rollout`, each
    with its finished samples and its unfinished ones (status ABORTED) as far as they got.
    """

    groups: list[list[Sample]] = field(default_factory=list)
    partial: list[list[Sample]] = field(default_factory=list)


class RoundStream(Protocol):
    """One generation round as it runs."""

    def advance(self) -> list[list[Sample]]:
        """Groups newly finished (at least one), or [] once nothing runs."""

    def abort(self) -> list[list[Sample]]:
        """Stop the round; the groups not finished, as they stand."""


class FinishedRound:
    """A round generated to the end before it is read: all groups at once, nothing to abort."""

    def __init__(self, samples: list[Sample]):
        self._groups = group_samples(samples)

    def advance(self) -> list[list[Sample]]:
        groups, self._groups = self._groups, []
        return groups

    def abort(self) -> list[list[Sample]]:
        return []


StartRound = Callable[[int, list[list[Sample]]], RoundStream]  # (round number, partial groups to resume)


@dataclass
class Collected:
    groups: list[list[Sample]]
    drops: Counter  # reason → number of groups dropped
    rounds: int
    resumed: int = 0  # partial groups continued in this rollout
    aborted: int = 0  # groups cut off at its end, carried over as partial

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/resumed_groups": self.resumed,
            "rollout/aborted_groups": self.aborted,
            **{f"rollout/dropped_groups/{reason}": n for reason, n in self.drops.items()},
        }


def collect_groups(start_round: StartRound, wanted: int, keep: GroupFilter, carry: CarryOver,
                   max_rounds: int = 32) -> Collected:
    """Fill `wanted` groups: first from `carry.groups`, then from generation rounds, filtering each group.

    `start_round(round, partial)` draws and starts the next round, continuing `partial` groups first. Groups
    are filtered as the round hands them out; once `wanted` are kept the round is aborted and its unfinished
    groups become `carry.partial` (a round that finished has none). Surplus kept groups stay in `carry.groups`.
    Raises RuntimeError after `max_rounds` rounds without enough groups, naming the filter as the cause.
    """
    kept = carry.groups[:wanted]
    carry.groups = carry.groups[wanted:]
    drops: Counter = Counter()
    rounds = resumed = aborted = 0
    while len(kept) < wanted:
        if rounds == max_rounds:
            raise RuntimeError(
                f"dynamic sampling kept {len(kept)} of {wanted} groups after {rounds} rounds "
                f"(dropped: {dict(drops)}); the filter rejects almost everything: check the reward function, "
                "raise --over-sampling-batch-size or drop --dynamic-sampling-filter-path"
            )
        resumed += len(carry.partial)
        stream = start_round(rounds, carry.partial)
        while len(kept) < wanted and (finished := stream.advance()):
            for group in finished:
                if not keep(group):
                    drops["all_rewards_equal" if len({s.reward for s in group}) == 1 else "filtered"] += 1
                elif len(kept) < wanted:
                    kept.append(group)
                else:
                    carry.groups.append(group)
        carry.partial = stream.abort()
        aborted += len(carry.partial)
        rounds += 1
    return Collected(kept, drops, rounds, resumed, aborted)
