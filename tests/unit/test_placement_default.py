"""`--colocate auto`: one actor for trainer rank i and engine i on a CPU run of one node, unless a flag needs the
engine on an actor of its own."""

from __future__ import annotations

import pytest

from vime_engine.config import build_config
from vime_engine.runtime.placement import with_placement_decided

REQUIRED = {"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl"}


def decided(device_kind: str = "cpu", *flags: str) -> bool:
    return with_placement_decided(build_config(list(flags), **REQUIRED), device_kind).placement.colocate


def test_a_cpu_run_of_one_node_is_colocated_by_default():
    assert decided() is True
    assert decided("cpu", "--actor-num-gpus-per-node", "2") is True  # an engine beside each of the two ranks
    assert decided("cpu", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2") is True


@pytest.mark.parametrize("flags", [
    ["--async-rollout"],
    ["--use-fault-tolerance"],
    ["--weight-sync", "broadcast"],
    ["--rollout-num-gpus", "2"],
    ["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"],
    ["--ray-address", "10.0.0.1:6379"],
    ["--train-backend", "megatron"],
])
def test_flags_that_need_the_engine_on_its_own_actor_keep_it_there(flags):
    assert decided("cpu", *flags) is False


@pytest.mark.parametrize("device_kind", ["cuda", "npu"])
def test_accelerators_keep_trainer_and_engine_apart(device_kind):
    assert decided(device_kind) is False


def test_an_explicit_choice_stands():
    assert decided("cpu", "--colocate", "false") is False
    assert decided("cuda", "--colocate") is True
