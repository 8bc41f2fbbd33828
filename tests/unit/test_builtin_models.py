"""Built-in models are materialized once per cache, also when several runs start on one machine at once."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from vime_engine.models.builtin import materialize_builtin_model


def _materialize_after(barrier, dest: str) -> int:
    barrier.wait()  # every process finds the cache empty and builds
    return materialize_builtin_model("tiny-qwen3", Path(dest)).stat().st_ino


def test_runs_building_the_same_model_at_once_all_keep_the_first_finished_copy(tmp_path):
    dest = tmp_path / "models" / "tiny-qwen3"
    spawn = multiprocessing.get_context("spawn")
    with spawn.Manager() as manager, spawn.Pool(3) as pool:
        barrier = manager.Barrier(3)
        returned = pool.starmap(_materialize_after, [(barrier, str(dest))] * 3)
    # A copy replaced after a run got it would vanish under that run: every run must get the one that stays.
    assert set(returned) == {dest.stat().st_ino}
    assert [p.name for p in dest.parent.iterdir()] == ["tiny-qwen3"]  # no staging directory left behind
    assert materialize_builtin_model("tiny-qwen3", dest).stat().st_ino == dest.stat().st_ino
