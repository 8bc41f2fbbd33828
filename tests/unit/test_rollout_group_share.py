"""Sharing a call's prompt groups over the rollout group's engines, and the flags that size the group."""

from __future__ import annotations

import random

import pytest

from vime_engine.config import ConfigError, build_config
from vime_engine.runtime.driver import local_cluster_cpus
from vime_engine.runtime.rollout_group import share_groups

REQUIRED = {"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl"}


def test_idle_engines_take_fresh_groups_in_equal_contiguous_runs():
    assert share_groups([0, 0], [], 4, 48) == ([], [2, 2])
    assert share_groups([0, 0, 0], [], 4, 48) == ([], [2, 1, 1])  # a tie goes to the lowest engine
    assert share_groups([0], [5, 7], 3, 48) == ([0, 0], [3])


def test_an_engine_with_outstanding_work_takes_less():
    # Engine 0 still has two groups of 48 tokens to generate for an earlier call: it takes none of the first two.
    assert share_groups([96, 0], [], 4, 48) == ([], [1, 3])


def test_resumed_groups_are_placed_first_by_their_remaining_tokens():
    # 40 tokens of resumed work go to engine 0, 10 to engine 1; the first fresh group evens them out (40, 40).
    assert share_groups([0, 0], [40, 10], 1, 30) == ([0, 1], [0, 1])
    assert share_groups([0, 0], [40, 10], 2, 30) == ([0, 1], [1, 1])


def test_every_group_placed_once_and_loads_within_one_group():
    rng = random.Random(0)
    for _ in range(200):
        engines = rng.randint(1, 5)
        resumed = [rng.randint(1, 60) for _ in range(rng.randint(0, 6))]
        fresh, fresh_cost = rng.randint(0, 12), rng.randint(1, 60)
        resumed_to, counts = share_groups([0] * engines, resumed, fresh, fresh_cost)
        assert len(resumed_to) == len(resumed) and all(0 <= e < engines for e in resumed_to)
        assert sum(counts) == fresh and len(counts) == engines
        loads = [sum(c for c, e in zip(resumed, resumed_to) if e == engine) + counts[engine] * fresh_cost
                 for engine in range(engines)]
        assert max(loads) - min(loads) <= max([*resumed, fresh_cost])


def test_no_engine_is_an_error():
    with pytest.raises(ValueError, match="at least one engine"):
        share_groups([], [], 1, 1)


def test_rollout_devices_size_the_group_and_the_local_cluster():
    cfg = build_config(["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"], **REQUIRED)
    assert cfg.rollout_engines == 2
    assert build_config([], **REQUIRED).rollout_engines == 1
    many = build_config(["--rollout-num-gpus", "6", "--actor-num-gpus-per-node", "2"], **REQUIRED)
    assert local_cluster_cpus(many) >= 8


@pytest.mark.parametrize("flags, message", [
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "does not split into engines .* multiple of 2"),
    (["--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine", "2"], "does not split into engines"),
    (["--rollout-num-gpus-per-engine", "0"], "at least 1 device"),
    (["--rollout-num-gpus", "2", "--colocate"], "devices of the 1 trainer ranks.* leave it out or give 1"),
    (["--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "3"],
     "--actor-num-gpus-per-node 4 does not split into engines of 3: use a divisor of 4"),
])
def test_rollout_layouts_that_cannot_run_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        build_config(flags, **REQUIRED)
