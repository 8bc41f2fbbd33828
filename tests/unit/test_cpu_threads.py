"""How many torch threads a CPU trainer rank or engine runs (Ray would give a one-CPU actor one)."""

from __future__ import annotations

import pytest

from vime_engine.config import build_config
from vime_engine.devices.accelerator import CPU_THREADS_ENV, cpu_thread_limit, cpu_threads
from vime_engine.preflight import PreflightError, check_on_device


def test_in_the_synchronous_loop_a_group_splits_every_core_of_its_node():
    # The other side waits while this one works, so it keeps no share.
    assert cpu_threads(cores=2, group_on_node=1, overlapped=False) == 2
    assert cpu_threads(cores=16, group_on_node=4, overlapped=False) == 4
    assert cpu_threads(cores=7, group_on_node=2, overlapped=False) == 3


def test_when_both_sides_work_at_once_the_other_keeps_a_share():
    assert cpu_threads(cores=2, group_on_node=1, overlapped=True) == 1
    assert cpu_threads(cores=12, group_on_node=2, overlapped=True) == 4


def test_an_actor_always_has_a_thread():
    assert cpu_threads(cores=2, group_on_node=4, overlapped=False) == 1
    assert cpu_threads(cores=1, group_on_node=1, overlapped=True) == 1


def test_a_limit_caps_the_share_and_never_raises_it():
    assert cpu_threads(cores=2, group_on_node=1, overlapped=False, limit=1) == 1
    assert cpu_threads(cores=16, group_on_node=4, overlapped=False, limit=8) == 4


def test_the_limit_comes_from_the_environment_and_a_bad_value_is_refused_before_ray_starts(monkeypatch):
    monkeypatch.delenv(CPU_THREADS_ENV, raising=False)
    assert cpu_thread_limit() is None
    monkeypatch.setenv(CPU_THREADS_ENV, "1")
    assert cpu_thread_limit() == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(CPU_THREADS_ENV, bad)
        with pytest.raises(PreflightError, match=f"{CPU_THREADS_ENV}={bad!r}: give a whole number"):
            check_on_device(build_config([], **{"hf-checkpoint": "m", "prompt-data": "p"}), "cpu")
