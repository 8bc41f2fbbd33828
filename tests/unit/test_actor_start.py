"""An actor's start-up runs without automatic collections, and its cycles are still freed at its end."""

from __future__ import annotations

import gc
import weakref

import pytest

from vime_engine.runtime.actor_start import start_up_without_collections


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


@pytest.fixture(autouse=True)
def collector_restored():
    yield
    gc.unfreeze()
    gc.enable()


def test_the_start_up_runs_without_the_collector_and_frees_its_cycles_at_the_end():
    with start_up_without_collections():
        assert not gc.isenabled()
        kept, dropped = Node(), Node()
        dropped_ref = weakref.ref(dropped)
        del dropped
        assert dropped_ref() is not None  # no collection ran by itself
    assert gc.isenabled()
    assert dropped_ref() is None, "the cycle left by the start-up was not collected at its end"
    assert gc.get_freeze_count() > 0 and kept.me is kept  # the survivors are frozen, not lost


def test_a_nested_block_leaves_the_collection_to_the_outer_one():
    with start_up_without_collections():
        with start_up_without_collections():
            pass
        assert not gc.isenabled(), "the inner block turned the collector back on"
        dropped = Node()
        dropped_ref = weakref.ref(dropped)
        del dropped
        assert dropped_ref() is not None
    assert gc.isenabled() and dropped_ref() is None
