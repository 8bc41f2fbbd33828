"""The rollout group: M = `--rollout-num-gpus / --rollout-num-gpus-per-engine` vLLM engines on Ray, driven as one.

Placement: one placement-group bundle per engine holding its `--rollout-num-gpus-per-engine` devices (on CPU as
many Ray CPUs: a "device" is a CPU there), packed onto as few nodes as the cluster allows; engine i runs in
bundle i. The colocated placement has one engine, the one inside the trainer's actor.

Dispatch: a call's prompt groups are shared out by `share_groups`, by the work each engine has outstanding
(response tokens it may still generate for earlier calls not yet collected). Fresh prompts go out as contiguous
runs, so an engine numbers its run's groups from the run's first group index as RolloutWorker does; resumed
partial groups carry their own indices. Collection puts the groups back in group-index order, the order one
engine returns them in.

Why the samples do not depend on M: sample j of group g draws from its own seed (`group_seed(...) + j`,
vime_engine.rollout.worker), and on CPU vLLM's result for a request does not depend on the other requests in its
batch, so a group comes out the same on whichever engine generates it (tests/component/test_rollout_group.py).

Streaming (partial rollout, `GroupRound`): the engines of a round advance in lockstep, each `advance` asking
every engine still running for its next finished groups and returning them together, so a round's course
depends on M but never on timing. Where `--partial-rollout` cuts a round off therefore depends on M (an engine
runs its own groups further than one engine would before reporting), so a partial rollout is reproducible for a
given M, not across M.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime_engine.config import EngineConfig
from vime_engine.data.records import PromptRecord
from vime_engine.rollout.worker import GenerationPlan, RolloutWorker
from vime_engine.runtime.devices import Accelerator
from vime_engine.runtime.placement import actor_resources, bundle_resources, describe, reserve
from vime_engine.sample import Sample
from vime_engine.weight_sync.buckets import TensorSpec
from vime_engine.weight_sync.endpoints import BroadcastReceiver, load_into_engine
from vime_engine.weight_sync.group import GroupAddress


class RolloutActor(RolloutWorker):
    """One engine of the disaggregated rollout group; adds the receiving end of the broadcast weight sync."""

    receiver: BroadcastReceiver | None = None

    def open_weight_receiver(
        self, address: GroupAddress, specs: list[TensorSpec], bucket_bytes: int, device: str, rank: int,
    ) -> None:
        self.receiver = BroadcastReceiver(address, specs, bucket_bytes, device, rank)

    def receive_weights(self, version: int) -> float:
        return load_into_engine(self.engine, self.receiver.stream(version), version)

    def loaded_weight_version(self) -> int:
        return self.weight_version


def share_groups(
    outstanding: list[int], resumed_costs: list[int], fresh: int, fresh_cost: int,
) -> tuple[list[int], list[int]]:
    """Spread one call's groups over the engines by outstanding work: greedy list scheduling, in order.

    Each group, the resumed ones first in the order given, then `fresh` new ones of `fresh_cost` each, goes to
    the engine with the least work counting `outstanding` and what this call gave it so far (the lowest engine
    index on a tie). Returns the engine of each resumed group and the number of fresh groups each engine takes;
    the caller hands fresh groups out as contiguous runs in engine order.
    Invariants: every group goes to exactly one engine; the result depends only on the arguments; from equal
    outstanding work, the engines' loads end at most one group's cost apart.
    """
    if not outstanding:
        raise ValueError("share_groups needs at least one engine")
    loads = list(outstanding)

    def least_loaded(cost: int) -> int:
        engine = min(range(len(loads)), key=lambda e: (loads[e], e))
        loads[engine] += cost
        return engine

    resumed_to = [least_loaded(cost) for cost in resumed_costs]
    fresh_counts = [0] * len(loads)
    for _ in range(fresh):
        fresh_counts[least_loaded(fresh_cost)] += 1
    return resumed_to, fresh_counts


@dataclass(frozen=True)
class Share:
    """What one engine generates of a call: fresh records numbered from `first_group`, resumed groups."""

    engine: int
    records: list[PromptRecord]
    resumed: list[list[Sample]]
    first_group: int
    work: int  # response tokens it may generate


def _remaining_tokens(group: list[Sample], max_tokens: int) -> int:
    return sum(max_tokens - s.response_length for s in group if not s.finished)


def _by_group_index(groups: list[list[Sample]]) -> list[list[Sample]]:
    return sorted(groups, key=lambda group: group[0].group_index)


class PendingSamples:
    """Samples being generated on one or more engines; `result()` waits for them, in group-index order."""

    def __init__(self, parts: list[ray.ObjectRef]):
        self.parts = parts

    def result(self) -> list[Sample]:
        samples = [s for part in ray.get(self.parts) for s in part]
        return sorted(samples, key=lambda s: s.group_index)  # stable: a group's samples keep their order


class GroupRound:
    """A round running on some engines of the group (a `RoundStream`), advanced in lockstep."""

    def __init__(self, engines: list):
        self.engines = engines
        self._running = list(engines)

    def advance(self) -> list[list[Sample]]:
        while self._running:
            finished = ray.get([engine.advance.remote() for engine in self._running])
            self._running = [engine for engine, groups in zip(self._running, finished) if groups]
            if any(finished):
                return _by_group_index([group for groups in finished for group in groups])
        return []

    def abort(self) -> list[list[Sample]]:
        unfinished = ray.get([engine.abort.remote() for engine in self.engines])
        return _by_group_index([group for groups in unfinished for group in groups])


class RolloutGroup:
    """The driver's handle on every engine: generation spread over them, weight versions checked together."""

    def __init__(self, engines: list, placement: PlacementGroup | None = None):
        self.engines = engines
        self.placement = placement  # None: the engines belong to someone else (the colocated trainer group)
        self._outstanding: list[dict[ray.ObjectRef, int]] = [{} for _ in engines]

    @classmethod
    def launch(cls, cfg: EngineConfig, accel: Accelerator, kv_cache_bytes: int | None) -> RolloutGroup:
        """`cfg.rollout_engines` RolloutActors, each in its own bundle of `--rollout-num-gpus-per-engine` devices."""
        per_engine, count = cfg.rollout.rollout_num_gpus_per_engine, cfg.rollout_engines
        bundle = bundle_resources(accel, per_engine)
        asked = (f"--rollout-num-gpus {count * per_engine} = {count} engine(s) × --rollout-num-gpus-per-engine "
                 f"{per_engine} ({describe(bundle)} each)")
        placement = reserve([bundle] * count, "PACK", asked)
        remote_class = ray.remote(RolloutActor)
        engines = [
            remote_class.options(
                runtime_env={"env_vars": dict(accel.actor_env)}, **actor_resources(accel, per_engine),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement, i),
            ).remote(cfg, kv_cache_bytes)
            for i in range(count)
        ]
        return cls(engines, placement)

    # -- generation ---------------------------------------------------------------------------------------------
    def _share(
        self, records: list[PromptRecord], resumed: list[list[Sample]], first_group: int, plan: GenerationPlan,
    ) -> list[Share]:
        """The engines given any group, each with its groups (see share_groups)."""
        max_tokens = plan.sampling.max_tokens
        resumed_costs = [_remaining_tokens(group, max_tokens) for group in resumed]
        fresh_cost = plan.n_samples * max_tokens
        resumed_to, fresh_counts = share_groups(self._outstanding_work(), resumed_costs, len(records), fresh_cost)
        shares, start = [], 0
        for engine, count in enumerate(fresh_counts):
            mine = [i for i, to in enumerate(resumed_to) if to == engine]
            if mine or count:
                shares.append(Share(
                    engine, records[start:start + count], [resumed[i] for i in mine], first_group + start,
                    sum(resumed_costs[i] for i in mine) + count * fresh_cost,
                ))
            start += count
        return shares

    def _outstanding_work(self) -> list[int]:
        """Per engine, the work of its generate calls not finished yet."""
        for calls in self._outstanding:
            if calls:
                done, _ = ray.wait(list(calls), num_returns=len(calls), timeout=0, fetch_local=False)
                for ref in done:
                    del calls[ref]
        return [sum(calls.values()) for calls in self._outstanding]

    def generate(
        self, records: list[PromptRecord], rollout_id: int, first_group: int, plan: GenerationPlan,
    ) -> PendingSamples:
        """`plan.n_samples` rewarded samples per record, spread over the engines; collected in record order."""
        parts = []
        for share in self._share(records, [], first_group, plan):
            ref = self.engines[share.engine].generate.remote(share.records, rollout_id, share.first_group, plan)
            self._outstanding[share.engine][ref] = share.work
            parts.append(ref)
        return PendingSamples(parts)

    def stream(
        self, records: list[PromptRecord], resumed: list[list[Sample]], rollout_id: int, first_group: int,
        plan: GenerationPlan,
    ) -> GroupRound:
        """Start a round on the engines (see RolloutWorker.begin), to be read group by group as they finish."""
        shares = self._share(records, resumed, first_group, plan)
        ray.get([self.engines[share.engine].begin.remote(share.records, share.resumed, rollout_id, share.first_group,
                                                         plan) for share in shares])
        return GroupRound([self.engines[share.engine] for share in shares])

    # -- weights ------------------------------------------------------------------------------------------------
    def check_weight_version(self, version: int) -> None:
        """Every engine holds `version`; else RuntimeError naming the engines that do not."""
        held = ray.get([engine.loaded_weight_version.remote() for engine in self.engines])
        behind = {i: v for i, v in enumerate(held) if v != version}
        if behind:
            raise RuntimeError(
                f"weight sync to version {version} left rollout engine(s) {behind} (engine: version held) on "
                "other weights; their samples would be off-policy"
            )

    def shutdown(self) -> None:
        if self.placement is None:
            return
        for engine in self.engines:
            with contextlib.suppress(Exception):
                ray.kill(engine)
        remove_placement_group(self.placement)
