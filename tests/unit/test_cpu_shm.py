"""The shared-memory names of a CPU tensor-parallel engine's shards (vime_engine.rollout.cpu_shm): a shard removes
its own stale names before its engine starts and its fresh ones after, never another shard's or group's."""

from __future__ import annotations

from pathlib import Path

from vime_engine.rollout.cpu_shm import released_after_start, segment_names


def _segments(shm: Path, *names: str) -> None:
    for name in names:
        (shm / name).write_bytes(b"")


def test_a_shard_releases_only_its_own_names(tmp_path):
    _segments(tmp_path, "-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1", "-tp:0-[2-3]-cpushm_0", "psm_1234")
    assert [p.name for p in segment_names(tmp_path, [0, 1], 0)] == ["-tp:0-[0-1]-cpushm_0"]

    with released_after_start([0, 1], 0, tmp_path):
        assert not (tmp_path / "-tp:0-[0-1]-cpushm_0").exists()  # a killed run's stale name: gone before the start
        _segments(tmp_path, "-tp:0-[0-1]-cpushm_0")  # what the starting engine creates
    assert sorted(p.name for p in tmp_path.iterdir()) == ["-tp:0-[0-1]-cpushm_1", "-tp:0-[2-3]-cpushm_0", "psm_1234"]
