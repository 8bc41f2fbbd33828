"""`DataSource`: an endless, resumable walk over the prompt records, epoch after epoch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vime_engine.data.records import PromptRecord


class DataSource:
    """Hands out prompt batches in a reproducible order and can resume mid-epoch.

    Invariants: epoch `e` visits every record exactly once, in `arange(n)` order, or with
    `shuffle` in the permutation drawn by `numpy.random.default_rng([seed, e])`. That generator
    is private, so the order depends only on (seed, epoch), never on global RNG state or on how
    many batches were taken before. The cursor is (epoch, offset into that epoch's order); a
    batch that runs past the end of an epoch continues into the next one.
    """

    def __init__(self, records: Sequence[PromptRecord], shuffle: bool, seed: int) -> None:
        if not records:
            raise ValueError("DataSource needs at least one prompt record")
        if seed < 0:
            raise ValueError(f"DataSource seed must be non-negative (numpy seeds), got {seed}")
        self._records = list(records)
        self._shuffle = shuffle
        self._seed = seed
        self._epoch = 0
        self._offset = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def epoch(self) -> int:
        return self._epoch

    def next_batch(self, n: int) -> list[PromptRecord]:
        """The next `n` records; advances the cursor, crossing epochs as needed."""
        if n <= 0:
            raise ValueError(f"batch size must be positive, got {n}")
        batch: list[PromptRecord] = []
        while len(batch) < n:
            if self._offset == len(self._records):
                self._epoch += 1
                self._offset = 0
                self._order = self._epoch_order(self._epoch)
            take = min(n - len(batch), len(self._records) - self._offset)
            batch.extend(self._records[i] for i in self._order[self._offset : self._offset + take])
            self._offset += take
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The cursor, plus what it is only valid for (dataset size, shuffle, seed); JSON-safe."""
        return {
            "epoch": self._epoch,
            "offset": self._offset,
            "num_records": len(self._records),
            "shuffle": self._shuffle,
            "seed": self._seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Move the cursor to a saved position; refuses a state saved for a different dataset
        size, shuffle flag or seed, since it would silently yield different batches."""
        expected = {"num_records": len(self._records), "shuffle": self._shuffle, "seed": self._seed}
        mismatched = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if mismatched:
            details = ", ".join(f"{k}: saved {saved!r}, now {now!r}" for k, (saved, now) in mismatched.items())
            raise ValueError(f"DataSource state does not fit this data source ({details})")
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= len(self._records):
            raise ValueError(f"DataSource state has an invalid cursor: epoch {epoch}, offset {offset}")
        self._epoch, self._offset = epoch, offset
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return np.arange(len(self._records))
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._records))
