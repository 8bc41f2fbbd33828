"""Dynamic sampling: over-sample prompts, keep only groups that carry a learning signal.

With `--over-sampling-batch-size M`, prompts are drawn M at a time; each group (the n samples of one prompt)
passes through the filter (`--dynamic-sampling-filter-path`, default: rewards not all equal, since a group
of equal rewards has zero GRPO advantage). A filter given without over-sampling applies as well, drawing
`--rollout-batch-size` prompts at a time, as in vime. The filter is vime's `(args, samples) -> bool |
DynamicFilterOutput` (an object with `keep` and `reason`; the reason names the drop in the metrics) or ours,
`(group) -> bool`. Kept groups fill the rollout batch; kept groups beyond it are carried over to the next
rollout, and that carry-over is part of the checkpoint.

With `--partial-rollout` a round is watched as it generates: groups are filtered as they finish, and once the
batch is full the groups still generating are aborted and carried over as they stand (tokens and log-probs so
far). The next rollout's first round continues them before drawing new prompts. The filter runs here, in the
driver, once per finished group; the engine's step loop is deterministic, so where the cut falls is too.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vime_engine.plugins.boundary import UserFunction
from vime_engine.plugins.loading import check_callable, import_function, parameter_names
from vime_engine.sample import Sample

GroupFilter = Callable[[list[Sample]], Any]  # a bool, or vime's DynamicFilterOutput (`keep`, `reason`)
TakeBuffered = Callable[[list[list[Sample]], int], list[list[Sample]]]  # (cut-off groups, draw size) -> to resume
FILTER_FLAG = "--dynamic-sampling-filter-path"


def rewards_differ(group: list[Sample]) -> bool:
    """Keep a group unless all its rewards are equal (zero advantage for every sample)."""
    return len({s.reward for s in group}) > 1


def load_group_filter(spec: str | None, args: Any = None) -> GroupFilter:
    """The filter named by `spec` (default `rewards_differ`). vime's form, told by a first parameter named
    `args` or two required ones, is called with `args` bound."""
    if spec is None:
        return rewards_differ
    vime = "`(args, samples: list[Sample], **kwargs) -> bool | DynamicFilterOutput`"
    fn = import_function(spec, FILTER_FLAG, vime)
    names = parameter_names(fn)
    if names[:1] == ["args"] or len(parameter_names(fn, required_only=True)) >= 2:
        fn = functools.partial(check_callable(fn, spec, FILTER_FLAG, ("args", "samples"), vime), args)
    else:
        fn = check_callable(fn, spec, FILTER_FLAG, ("group",), "`(group: list[Sample]) -> bool`")
    return UserGroupFilter(UserFunction(fn, FILTER_FLAG))


@dataclass(frozen=True)
class UserGroupFilter:
    """A user's filter called through the boundary (vime_engine/plugins/boundary.py): an exception inside names
    the group, and None or a str is refused, whose truth would decide in silence (a forgotten `return` drops
    every group; every str, "False" too, keeps it)."""

    fn: UserFunction

    def __call__(self, group: list[Sample]) -> Any:
        where = f"group {group[0].group_index}" if group else None
        output = self.fn.call(group, sample=where)
        keep = getattr(output, "keep", output)
        if keep is None or isinstance(keep, (str, bytes)):
            raise self.fn.error(f"returned {output!r}; return a bool, or vime's DynamicFilterOutput (keep, reason)",
                                where)
        return output


def verdict(output: Any) -> tuple[bool, str | None]:
    """A filter's answer as (keep, reason): a bool, or an object with `keep` and `reason` (vime's
    DynamicFilterOutput; its `keep_when_insufficient` is not read, a rejected group is always dropped)."""
    return bool(getattr(output, "keep", output)), getattr(output, "reason", None)


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
    seen: list[list[Sample]] = field(default_factory=list)  # every group its rounds finished: kept, dropped, surplus

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
                   max_rounds: int = 32, take_buffered: TakeBuffered | None = None, draw_size: int = 0) -> Collected:
    """Fill `wanted` groups: first from `carry.groups`, then from generation rounds, filtering each group.

    `start_round(round, partial)` draws and starts the next round, continuing `partial` groups first: all of
    `carry.partial`, or those `take_buffered(carry.partial, draw_size)` picks (the rest wait for a later round).
    Groups are filtered as the round hands them out; once `wanted` are kept the round is aborted and its
    unfinished groups join `carry.partial` (a round that finished has none). Surplus kept groups stay in
    `carry.groups`. Raises RuntimeError after `max_rounds` rounds without enough groups, naming the filter.
    """
    kept = carry.groups[:wanted]
    carry.groups = carry.groups[wanted:]
    drops: Counter = Counter()
    seen: list[list[Sample]] = []
    rounds = resumed = aborted = 0
    while len(kept) < wanted:
        if rounds == max_rounds:
            raise RuntimeError(
                f"dynamic sampling kept {len(kept)} of {wanted} groups after {rounds} rounds "
                f"(dropped: {dict(drops)}); the filter rejects almost everything: check the reward function, "
                "raise --over-sampling-batch-size or drop --dynamic-sampling-filter-path"
            )
        resuming = carry.partial if take_buffered is None else take_buffered(carry.partial, draw_size)
        waiting = [g for g in carry.partial if not any(g is r for r in resuming)]
        resumed += len(resuming)
        stream = start_round(rounds, resuming)
        while len(kept) < wanted and (finished := stream.advance()):
            seen += finished
            for group in finished:
                keep_it, reason = verdict(keep(group))
                if not keep_it:
                    drops[reason or ("all_rewards_equal" if len({s.reward for s in group}) == 1 else "filtered")] += 1
                elif len(kept) < wanted:
                    kept.append(group)
                else:
                    carry.groups.append(group)
        cut_off = stream.abort()
        aborted += len(cut_off)
        carry.partial = waiting + cut_off
        rounds += 1
    return Collected(kept, drops, rounds, resumed, aborted, seen)
