"""The run's metrics history: one record per rollout (and evaluation), kept in one append-only file.

`history.jsonl` lies at the checkpoint root beside LATEST. A save appends the records logged since the last
save (flushed and fsynced before the checkpoint's manifest is written) and the checkpoint's driver.json keeps
only a `HistoryMark`: how many lines and bytes of the file belong to it and the sha256 of those bytes. So a
checkpoint's size does not grow with the run, and the driver holds in memory only the records not saved yet.

Every checkpoint reads only its own prefix and checks it against its mark, so lines appended after it (by a
later save, or a torn line of a run killed mid-append) never change what it sees. A resume cuts the file back
to the resumed checkpoint's prefix, which drops what an interrupted run logged after it (the same cut the
metrics sink's metrics.jsonl gets). Checkpoints written before the file existed carry their whole history as
a list in driver.json: a resume takes that list as the history so far.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vime_engine.checkpoint.store import write_atomic

HISTORY_FILE = "history.jsonl"
MARK_KEY = "history_mark"  # driver.json's key of the mark; the key of the old whole-history list is "history"
_EMPTY_SHA256 = hashlib.sha256().hexdigest()


class HistoryError(ValueError):
    """The history file does not hold what a checkpoint's mark says."""


@dataclass(frozen=True)
class HistoryMark:
    lines: int = 0
    bytes: int = 0
    sha256: str = _EMPTY_SHA256

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> HistoryMark:
        return cls(int(value["lines"]), int(value["bytes"]), str(value["sha256"]))


def encode(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, sort_keys=True, default=str) + "\n").encode()


def checked_prefix(data: bytes, mark: HistoryMark, where: str) -> bytes:
    """The first `mark.bytes` of `data` (a history file's content), checked against the mark."""
    if len(data) < mark.bytes:
        raise HistoryError(f"{where}: {len(data)} bytes, the checkpoint needs its first {mark.bytes} "
                           f"({mark.lines} records): the file was cut or replaced; resume from an older checkpoint")
    prefix = data[:mark.bytes]
    if hashlib.sha256(prefix).hexdigest() != mark.sha256 or prefix.count(b"\n") != mark.lines:
        raise HistoryError(f"{where}: its first {mark.bytes} bytes do not match the checkpoint's sha256 "
                           f"{mark.sha256[:12]}… ({mark.lines} records): the file was changed after the save")
    return prefix


def parse(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.splitlines()]


def saved_records(driver_state: dict[str, Any], read_file: Callable[[], bytes], where: str) -> list[dict[str, Any]]:
    """A checkpoint's whole history from its driver.json and `read_file()`, the bytes of the history file at
    `where` (only called when the checkpoint has a mark; a checkpoint of the old layout holds the list itself)."""
    if MARK_KEY not in driver_state:
        return list(driver_state.get("history", []))
    mark = HistoryMark.from_json(driver_state[MARK_KEY])
    return parse(checked_prefix(read_file(), mark, where))


@dataclass
class RunHistory:
    """The history of a run: what is in the file (up to `mark`) and the records logged since the last save.

    `path` None: a run without --save (or an eval-only load) keeps its records in memory; nothing resumes it.
    """

    path: Path | None = None
    mark: HistoryMark = field(default_factory=HistoryMark)
    pending: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._sha = hashlib.sha256()  # of the file's first mark.bytes; `start` feeds it the resumed prefix

    def append(self, record: dict[str, Any]) -> None:
        self.pending.append(record)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Every record of the run so far, the saved ones read from the file."""
        if self.path is not None and self.mark.bytes:
            with open(self.path, "rb") as f:
                for line in f.read(self.mark.bytes).splitlines():
                    yield json.loads(line)
        yield from self.pending

    def persist(self) -> HistoryMark:
        """Append the pending records to the file and fsync it (a checkpoint is about to point at them)."""
        if self.path is None:
            raise HistoryError("a run without a checkpoint directory has no history file")
        data = b"".join(encode(r) for r in self.pending)
        with open(self.path, "r+b" if self.path.exists() else "wb") as f:
            f.truncate(self.mark.bytes)  # a torn or orphaned tail of an interrupted save goes
            f.seek(self.mark.bytes)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._sha.update(data)
        self.mark = HistoryMark(self.mark.lines + len(self.pending), self.mark.bytes + len(data),
                                self._sha.hexdigest())
        self.pending = []
        return self.mark

    @classmethod
    def start(cls, root: Path | None, saved: list[dict[str, Any]] | bytes = b"") -> RunHistory:
        """The history of a run that continues from `saved` (the resumed checkpoint's records, or its checked
        file prefix), its file at `root` made to hold exactly that (none for a fresh run: what an earlier run that
        saved nothing left there goes)."""
        data = saved if isinstance(saved, bytes) else b"".join(encode(r) for r in saved)
        if root is None:
            return cls(None, pending=parse(data))
        path = Path(root) / HISTORY_FILE
        if not data:  # a fresh run: the first save makes the file (a run that fails before it leaves no empty one)
            path.unlink(missing_ok=True)
            return cls(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not (path.is_file() and _has_prefix(path, data)):
            write_atomic(path, data)
        with open(path, "r+b") as f:  # drop what an interrupted run appended after the resumed checkpoint
            f.truncate(len(data))
            os.fsync(f.fileno())
        history = cls(path, HistoryMark(data.count(b"\n"), len(data), hashlib.sha256(data).hexdigest()))
        history._sha.update(data)
        return history


def read_checked(path: Path, mark: HistoryMark) -> bytes:
    """The file's prefix that belongs to a checkpoint with `mark` (HistoryError naming the file if it differs)."""
    try:
        with open(path, "rb") as f:
            data = f.read(mark.bytes)
    except FileNotFoundError:
        raise HistoryError(f"{path}: missing, and the checkpoint's {mark.lines} history records live there "
                           "(copy it beside the checkpoint directories, or resume from an older checkpoint)") from None
    return checked_prefix(data, mark, str(path))


def _has_prefix(path: Path, data: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(data)) == data
