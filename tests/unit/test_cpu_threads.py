"""How many torch threads a CPU trainer rank or engine runs (Ray would give a one-CPU actor one)."""

from __future__ import annotations

from vime_engine.devices.accelerator import cpu_threads


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
