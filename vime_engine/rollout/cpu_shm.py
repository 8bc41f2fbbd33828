"""The shared-memory names of vLLM's CPU tensor-parallel engines, released once the engine has started.

On CPU the shards of a tensor-parallel engine exchange activations through shared-memory segments (/dev/shm), one
per shard, named after the engine's process-group address and the shard's group. An engine spread over trainer
ranks (vLLM's external-launcher mode) has the same address, "env://", in every run, so a segment that a killed run
left behind makes the next run's engine fail to start (`create shm in SHMManager failed. errno: 17`, EEXIST).
The names are only needed while the shards join each other: once the engine is built every shard has its segments
mapped, so each shard removes its name then (the memory lives until the processes end), and a stale name of its
own from a run killed while starting is removed before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def segment_names(shm_dir: Path, group_ranks: list[int], shard: int) -> list[Path]:
    """The segments shard `shard` of the tensor-parallel group of global `group_ranks` names (vLLM calls them
    `<address>-tp:<n>-[<ranks joined by ->]-cpushm_<shard>`)."""
    suffix = f"-[{'-'.join(map(str, group_ranks))}]-cpushm_{shard}"
    return [path for path in shm_dir.glob("*cpushm_*") if path.name.endswith(suffix) and "-tp:" in path.name]


@contextlib.contextmanager
def released_after_start(group_ranks: list[int], shard: int, shm_dir: Path = SHM_DIR) -> Iterator[None]:
    """Around building shard `shard`'s engine: its stale names removed before, its fresh names after."""
    for path in segment_names(shm_dir, group_ranks, shard):
        path.unlink(missing_ok=True)
    yield
    for path in segment_names(shm_dir, group_ranks, shard):
        path.unlink(missing_ok=True)
