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

Fault tolerance (`--use-fault-tolerance`, slime's flags): while the driver waits for generation it watches the
engines: a call that fails because its engine's process died (Ray's RayActorError) shows a death at once, and
every `--rollout-health-check-interval` seconds the engines still working are asked for `health` (answered on a
thread of its own, beside a running generation); one silent for `--rollout-health-check-timeout` is killed. A
dead engine is replaced by a new actor in its bundle, which loads the current weights version
(`resync`), and the calls it had not finished are sent to it again: the same groups from the same seeds, so the
same samples. Past `--rollout-max-engine-restarts` restarts in a run, the next death ends it with an error
raised from Ray's, which the chunk runner classifies as infrastructure (a retry resumes from the checkpoint); so
does a death whose bundle Ray cannot place again (its node left the cluster and no other node has room), instead
of a new actor that would wait for devices forever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import ray
from ray.actor import ActorHandle
from ray.exceptions import OutOfMemoryError, RayActorError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vime_engine.config import EngineConfig
from vime_engine.data.records import PromptRecord
from vime_engine.rollout.worker import GenerationPlan, RolloutWorker
from vime_engine.devices.accelerator import Accelerator, use_cpu_share
from vime_engine.runtime.actor_start import start_up_without_collections
from vime_engine.runtime.placement import (
    PLACEMENT_TIMEOUT_S, actor_resources, bundle_resources, describe, reserve, wait_until_placed,
)
from vime_engine.sample import Sample
from vime_engine.weight_sync.buckets import TensorSpec

if TYPE_CHECKING:  # the engines' side of the weight sync, imported where it runs (torch stays out of the driver)
    from vime_engine.weight_sync.endpoints import BroadcastReceiver
    from vime_engine.weight_sync.group import GroupAddress

log = logging.getLogger(__name__)
HEALTH = "health"  # the concurrency group `health` runs in, so it answers while a generation runs


class RolloutEngine(Protocol):
    """What the group calls on each engine's actor: a RolloutActor (below), or a trainer rank that holds an engine
    (vime_engine/runtime/workers.py, colocated). Only a RolloutActor answers `health`: only the group's own engines
    are watched and replaced (`--use-fault-tolerance`)."""

    def generate(self, records: list[PromptRecord], rollout_id: int, first_group: int,
                 plan: GenerationPlan) -> list[Sample]: ...

    def begin(self, records: list[PromptRecord], resumed: list[list[Sample]], rollout_id: int, first_group: int,
              plan: GenerationPlan) -> None: ...

    def advance(self) -> list[list[Sample]]: ...

    def abort(self) -> list[list[Sample]]: ...

    def loaded_weight_version(self) -> int: ...


# An engine's actor, or what answers the same `.method.remote(...)` calls for an engine spread over several
# colocated trainer ranks (vime_engine.runtime.workers.TensorParallelEngine).
EngineHandle = ActorHandle[RolloutEngine]


class RolloutActor(RolloutWorker):
    """One engine of the disaggregated rollout group; adds the receiving end of the broadcast weight sync."""

    receiver: BroadcastReceiver | None = None

    def __init__(self, cfg: EngineConfig, kv_cache_bytes: int | None, on_cpu: bool):
        with start_up_without_collections():
            if on_cpu:
                use_cpu_share(cfg.rollout_engines, cfg.placement.async_rollout)
            super().__init__(cfg, kv_cache_bytes)

    def open_weight_receiver(
        self, address: GroupAddress, specs: list[TensorSpec], bucket_bytes: int, device: str, rank: int,
    ) -> None:
        from vime_engine.weight_sync.endpoints import BroadcastReceiver

        self.receiver = BroadcastReceiver(address, specs, bucket_bytes, device, rank)

    def receive_weights(self, version: int) -> float:
        from vime_engine.weight_sync.endpoints import load_into_engine

        return load_into_engine(self.engine, self.receiver.stream(version), version)

    def loaded_weight_version(self) -> int:
        return self.weight_version

    @ray.method(concurrency_group=HEALTH)
    def health(self) -> int:
        """Answers while the engine's process lives and Ray reaches it: the process id."""
        return os.getpid()


@dataclass(frozen=True)
class FaultTolerance:
    """How the group watches its engines (`--use-fault-tolerance` and slime's health-check flags)."""

    interval: float  # seconds between health checks while generation is awaited
    timeout: float  # seconds an engine may take to answer one
    first_wait: float  # seconds after an engine (re)starts before it is checked
    max_restarts: int  # restarts in a run; the next death ends it

    @classmethod
    def of(cls, cfg: EngineConfig) -> FaultTolerance | None:
        r = cfg.rollout
        if not r.use_fault_tolerance:
            return None
        return cls(r.rollout_health_check_interval, r.rollout_health_check_timeout,
                   r.rollout_health_check_first_wait, r.rollout_max_engine_restarts)


class EngineLost(RuntimeError):
    """An engine died and cannot be restarted (the run used up its restarts, or its devices are gone); raised from
    Ray's error, so the chunk is retried."""


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


def reserve_engine_bundles(cfg: EngineConfig, accel: Accelerator) -> PlacementGroup:
    """A placement group of one bundle per engine, each of `--rollout-num-gpus-per-engine` devices, packed onto as
    few nodes as the cluster allows; a cluster that cannot hold them is refused naming the flags (reserve)."""
    per_engine, count = cfg.rollout.rollout_num_gpus_per_engine, cfg.rollout_engines
    bundle = bundle_resources(accel, per_engine)
    asked = (f"--rollout-num-gpus {count * per_engine} = {count} engine(s) × --rollout-num-gpus-per-engine "
             f"{per_engine} ({describe(bundle)} each)")
    return reserve([bundle] * count, "PACK", asked)


@dataclass(frozen=True)
class Share:
    """What one engine generates of a call: fresh records numbered from `first_group`, resumed groups."""

    engine: int
    records: list[PromptRecord]
    resumed: list[list[Sample]]
    first_group: int
    work: int  # response tokens it may generate


@dataclass(frozen=True)
class GenerateCall:
    """One engine's generate call of a `RolloutGroup.generate`: enough to send it again to a restarted engine."""

    share: Share
    rollout_id: int
    plan: GenerationPlan
    actor: object  # the engine's actor handle the call went to
    ref: ray.ObjectRef


def _remaining_tokens(group: list[Sample], max_tokens: int) -> int:
    return sum(max_tokens - s.response_length for s in group if not s.finished)


def _by_group_index(groups: list[list[Sample]]) -> list[list[Sample]]:
    return sorted(groups, key=lambda group: group[0].group_index)


class PendingSamples:
    """Samples being generated on one or more engines; `result()` waits for them, in group-index order."""

    def __init__(self, group: RolloutGroup, calls: list[GenerateCall]):
        self.group, self.calls = group, calls

    def result(self) -> list[Sample]:
        if self.group.fault_tolerance is None:
            parts = ray.get([call.ref for call in self.calls])
        else:
            parts = self.group.collect(self.calls)
        samples = [s for part in parts for s in part]
        return sorted(samples, key=lambda s: s.group_index)  # stable: a group's samples keep their order


class GroupRound:
    """A round running on some engines of the group (a `RoundStream`), advanced in lockstep."""

    def __init__(self, engines: list[EngineHandle]):
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

    def __init__(self, engines: list[EngineHandle], placement: PlacementGroup | None = None,
                 start_engine: Callable[[int], EngineHandle] | None = None):
        self.engines = engines
        self.placement = placement  # None: the engines belong to someone else (the colocated trainer group)
        self._start_engine = start_engine  # a new actor for engine i, in bundle i
        self._outstanding: list[dict[ray.ObjectRef, int]] = [{} for _ in engines]
        self.fault_tolerance: FaultTolerance | None = None
        self._resync: Callable[[object], None] | None = None
        self._started = [time.monotonic()] * len(engines)
        self.restarts = 0
        self.recovery_seconds: list[float] = []  # per restart: from the death seen to the new engine loaded

    @classmethod
    def launch(cls, cfg: EngineConfig, accel: Accelerator, kv_cache_bytes: int | None) -> RolloutGroup:
        """`cfg.rollout_engines` RolloutActors, each in its own bundle of `--rollout-num-gpus-per-engine` devices."""
        per_engine, count = cfg.rollout.rollout_num_gpus_per_engine, cfg.rollout_engines
        placement = reserve_engine_bundles(cfg, accel)
        remote_class = ray.remote(concurrency_groups={HEALTH: 1})(RolloutActor)

        def start_engine(i: int) -> EngineHandle:
            return remote_class.options(
                runtime_env={"env_vars": dict(accel.actor_env)}, **actor_resources(accel, per_engine),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement, i),
            ).remote(cfg, kv_cache_bytes, accel.kind == "cpu")

        return cls([start_engine(i) for i in range(count)], placement, start_engine)

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
        calls = [self._send(share, rollout_id, plan) for share in self._share(records, [], first_group, plan)]
        return PendingSamples(self, calls)

    def _send(self, share: Share, rollout_id: int, plan: GenerationPlan) -> GenerateCall:
        actor = self.engines[share.engine]
        ref = actor.generate.remote(share.records, rollout_id, share.first_group, plan)
        self._outstanding[share.engine][ref] = share.work
        return GenerateCall(share, rollout_id, plan, actor, ref)

    def stream(
        self, records: list[PromptRecord], resumed: list[list[Sample]], rollout_id: int, first_group: int,
        plan: GenerationPlan,
    ) -> GroupRound:
        """Start a round on the engines (see RolloutWorker.begin), to be read group by group as they finish."""
        shares = self._share(records, resumed, first_group, plan)
        ray.get([self.engines[share.engine].begin.remote(share.records, share.resumed, rollout_id, share.first_group,
                                                         plan) for share in shares])
        return GroupRound([self.engines[share.engine] for share in shares])

    # -- fault tolerance ------------------------------------------------------------------------------------------
    def watch(self, policy: FaultTolerance, resync: Callable[[object], None]) -> None:
        """Replace engines that die (see the module's doc); `resync(actor)` loads the current weights into one."""
        if self._start_engine is None:
            raise ValueError("the colocated engine lives in the trainer's actor: the rollout group cannot restart it")
        self.fault_tolerance, self._resync = policy, resync

    def collect(self, calls: list[GenerateCall]) -> list[list[Sample]]:
        """Each call's samples, in the calls' order; the calls of an engine that died are sent again to its
        replacement."""
        policy, results = self.fault_tolerance, {}
        pending = dict(enumerate(calls))
        next_check = time.monotonic() + policy.interval
        while pending:
            by_ref = {call.ref: k for k, call in pending.items()}
            done, _ = ray.wait(list(by_ref), num_returns=1, timeout=max(0.0, next_check - time.monotonic()))
            dead: dict[int, tuple[object, BaseException]] = {}
            for ref in done:
                call = pending[by_ref[ref]]
                try:
                    results[by_ref[ref]] = ray.get(ref)
                    del pending[by_ref[ref]]
                except RayActorError as error:
                    dead[call.share.engine] = (call.actor, error)
            if time.monotonic() >= next_check:
                self._kill_silent({call.share.engine for call in pending.values()})
                next_check = time.monotonic() + policy.interval
            for engine, (actor, error) in dead.items():
                if actor is self.engines[engine]:  # else a late failure of an engine already replaced
                    self.replace(engine, error)
            for k, call in pending.items():
                if call.actor is not self.engines[call.share.engine]:
                    pending[k] = self._send(call.share, call.rollout_id, call.plan)
        return [results[k] for k in range(len(calls))]

    def _kill_silent(self, engines: set[int]) -> None:
        """Kill the engines that do not answer a health check in time (their calls then fail as dead)."""
        for engine in self._unhealthy(engines):
            ray.kill(self.engines[engine], no_restart=True)

    def _unhealthy(self, holders: Iterable[int]) -> dict[int, BaseException]:
        """The weight holders among `holders`, past their first wait, that do not answer a health check within the
        timeout or answer it with an error, each with what it answered."""
        policy, now = self.fault_tolerance, time.monotonic()
        checked = [e for e in sorted(holders) if now - self._started[e] >= policy.first_wait]
        pings = {self.weight_holders[e].health.remote(): e for e in checked}
        answered, _ = ray.wait(list(pings), num_returns=len(pings), timeout=policy.timeout)
        failed: dict[int, BaseException] = {}
        for ref, engine in pings.items():
            try:
                if ref not in answered:
                    raise TimeoutError(f"no answer to a health check in {policy.timeout:.0f} s")
                ray.get(ref)
            except Exception as error:  # whatever it answered, the engine is not healthy
                log.warning("rollout engine %d failed a health check: %s", engine, error)
                failed[engine] = error
        return failed

    def replace(self, engine: int, error: BaseException) -> None:
        """A new actor for a dead engine (weight holder `engine`), in its bundle, loaded with the current weights; a
        new one that dies before it has loaded (Ray's memory monitor, say) is one more death."""
        policy, seen = self.fault_tolerance, time.monotonic()
        while True:
            if self.restarts >= policy.max_restarts:
                raise EngineLost(
                    f"rollout engine {engine} died after the run restarted engines {self.restarts} time(s) "
                    f"(--rollout-max-engine-restarts {policy.max_restarts}): ending the run so that it is retried "
                    f"from its last checkpoint; the engine's error: {error}"
                ) from error
            if not wait_until_placed(self.placement, engine, PLACEMENT_TIMEOUT_S):
                raise EngineLost(
                    f"rollout engine {engine} died and Ray did not place its devices again within "
                    f"{PLACEMENT_TIMEOUT_S}s (its node left the cluster and no other node has room): ending the run "
                    f"so that it is retried from its last checkpoint; the engine's error: {error}"
                ) from error
            log.warning("rollout engine %d died (%s: %s): starting a new one in its bundle", engine,
                        type(error).__name__, str(error).splitlines()[0] if str(error) else "")
            self._retire(engine)
            self.weight_holders[engine] = self._start_engine(engine)  # in place: the weight sync holds this list
            self.restarts += 1
            try:
                self._resync(self.weight_holders[engine])
                break
            except (RayActorError, OutOfMemoryError) as died:
                if isinstance(died, RayActorError) and died.actor_init_failed:
                    raise  # the constructor's own error: another start would raise it again
                error = died
        self._started[engine] = time.monotonic()
        self.recovery_seconds.append(self._started[engine] - seen)
        log.warning("rollout engine %d restarted and loaded the current weights in %.1f s", engine,
                    self.recovery_seconds[-1])

    def _retire(self, engine: int) -> None:
        """End a dead engine's actor, if anything of it is left, and forget the calls it had."""
        with contextlib.suppress(Exception):
            ray.kill(self.engines[engine], no_restart=True)
        self._outstanding[engine] = {}

    def replace_dead(self) -> None:
        """Replace every engine whose process is gone (after a call to all of them failed)."""
        for engine, actor in enumerate(self.weight_holders):
            try:
                ray.get(actor.health.remote(), timeout=self.fault_tolerance.timeout)
            except RayActorError as error:
                self.replace(engine, error)

    def actors(self) -> list:
        """Every actor of the group (e.g. to wait until all have started)."""
        return list(self.engines)

    # -- weights ------------------------------------------------------------------------------------------------
    @property
    def weight_holders(self) -> list:
        """The actors the weight sync loads: the engines (in server mode, the servers behind the dispatcher)."""
        return self.engines

    def check_weight_version(self, version: int) -> None:
        """Every engine holds `version`; else RuntimeError naming the engines that do not."""
        held = ray.get([engine.loaded_weight_version.remote() for engine in self.weight_holders])
        behind = {i: v for i, v in enumerate(held) if v != version}
        if behind:
            raise RuntimeError(
                f"weight sync to version {version} left rollout engine(s) {behind} (engine: version held) on "
                "other weights; their samples would be off-policy"
            )

    def recovery_metrics(self) -> dict[str, float]:
        """Engine restarts so far and the seconds they took, for the rollout's log (empty without restarts)."""
        if not self.restarts:
            return {}
        return {"rollout/engine_restarts": self.restarts, "perf/engine_recovery_time": sum(self.recovery_seconds)}

    def shutdown(self) -> None:
        if self.placement is None:
            return
        for engine in self.engines:
            with contextlib.suppress(Exception):
                ray.kill(engine)
        remove_placement_group(self.placement)
