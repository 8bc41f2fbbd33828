"""Dynamic sampling: over-sample prompts, keep only groups that carry a learning signal.

With `--over-sampling-batch-size M`, prompts are drawn M at a time; each group (the n samples of one prompt)
passes through the filter (`--dynamic-sampling-filter-path`, default: rewards not all equal, since a group
of equal rewards has zero GRPO advantage). Kept groups fill the rollout batch; kept groups beyond it are
carried over to the next rollout, and that carry-over is part of the checkpoint.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

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
    """Kept groups waiting for the next rollout; saved with the checkpoint."""

    groups: list[list[Sample]] = field(default_factory=list)


@dataclass
class Collected:
    groups: list[list[Sample]]
    drops: Counter  # reason → number of groups dropped
    rounds: int

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]


def collect_groups(
    generate: Callable[[int], list[Sample]], wanted: int, keep: GroupFilter, carry: CarryOver, max_rounds: int = 32
) -> Collected:
    """Fill `wanted` groups: first from `carry`, then from `generate(round)` calls, filtering each group.

    `generate` draws and generates the next batch of prompts. Surplus kept groups stay in `carry`.
    Raises RuntimeError after `max_rounds` rounds without enough groups, naming the filter as the cause.
    """
    kept = carry.groups[:wanted]
    carry.groups = carry.groups[wanted:]
    drops: Counter = Counter()
    rounds = 0
    while len(kept) < wanted:
        if rounds == max_rounds:
            raise RuntimeError(
                f"dynamic sampling kept {len(kept)} of {wanted} groups after {rounds} rounds "
                f"(dropped: {dict(drops)}); the filter rejects almost everything: check the reward function, "
                "raise --over-sampling-batch-size or drop --dynamic-sampling-filter-path"
            )
        for group in group_samples(generate(rounds)):
            if not keep(group):
                drops["all_rewards_equal" if len({s.reward for s in group}) == 1 else "filtered"] += 1
            elif len(kept) < wanted:
                kept.append(group)
            else:
                carry.groups.append(group)
        rounds += 1
    return Collected(kept, drops, rounds)
