"""--use-fault-tolerance: the placements it cannot serve are refused, and a death past the restart limit ends the
chunk with the retryable infrastructure exit code."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError

from tasks.engine_job.runner import EXIT_INFRASTRUCTURE, exit_code_for
from vime_engine.config import ConfigError, build_config
from vime_engine.runtime.rollout_group import EngineLost, FaultTolerance, RolloutGroup

REQUIRED = {"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl"}


@pytest.mark.parametrize(("flags", "named"), [
    (["--weight-sync", "broadcast"], "--weight-sync object_store"),
    (["--colocate"], "drop --colocate"),
    (["--async-rollout"], "drop --async-rollout"),
    (["--partial-rollout", "--over-sampling-batch-size", "16"], "drop --partial-rollout"),
])
def test_placements_a_restarted_engine_cannot_rejoin_are_refused(flags, named):
    with pytest.raises(ConfigError, match="--use-fault-tolerance") as refused:
        build_config(["--use-fault-tolerance", *flags], **REQUIRED)
    assert named in str(refused.value)
    build_config(flags, **REQUIRED)  # each is fine without fault tolerance


def test_the_flags_reach_the_policy():
    cfg = build_config(["--use-fault-tolerance", "--rollout-health-check-interval", "2",
                        "--rollout-health-check-timeout", "5", "--rollout-health-check-first-wait", "7",
                        "--rollout-max-engine-restarts", "1"], **REQUIRED)
    assert FaultTolerance.of(cfg) == FaultTolerance(interval=2.0, timeout=5.0, first_wait=7.0, max_restarts=1)
    assert FaultTolerance.of(build_config([], **REQUIRED)) is None


def test_a_death_past_the_restart_limit_ends_the_chunk_as_retryable():
    started = []
    group = RolloutGroup([object()], start_engine=started.append)
    group.watch(FaultTolerance(interval=1, timeout=1, first_wait=0, max_restarts=0), resync=started.append)
    with pytest.raises(EngineLost, match="--rollout-max-engine-restarts 0") as ended:
        group.replace(0, ActorDiedError())
    assert started == []  # nothing restarted
    assert exit_code_for(ended.value) == EXIT_INFRASTRUCTURE
