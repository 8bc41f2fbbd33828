"""Reading the history rows back from a W&B transaction log (`run-<id>.wandb`), offline or online.

The file is W&B's record log: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then LevelDB-log-style
32 KiB blocks of chunks, each with a header of CRC-32 (over the chunk type and data), length and type (full,
first, middle, last); a record is one serialized `wandb.proto` Record. A log cut short by a kill ends in an
incomplete or corrupt chunk: reading stops there, as W&B's own sync does.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

FILE_HEADER = struct.Struct("<4sHB")
CHUNK_HEADER = struct.Struct("<IHB")
BLOCK_SIZE = 32 * 1024
IDENT, MAGIC = b":W&B", 0xBEE1
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """The complete records of the log at `path`, in order."""
    data = path.read_bytes()
    if len(data) < FILE_HEADER.size:
        return  # created, nothing written yet
    ident, magic, _version = FILE_HEADER.unpack_from(data)
    if (ident, magic) != (IDENT, MAGIC):
        raise ValueError(f"{path} is not a W&B transaction log (header {data[:FILE_HEADER.size]!r})")
    pos, pending = FILE_HEADER.size, b""
    while True:
        room = BLOCK_SIZE - pos % BLOCK_SIZE
        if room < CHUNK_HEADER.size:  # too small for a chunk header: the writer padded to the next block
            pos += room
            continue
        if pos + CHUNK_HEADER.size > len(data):
            return
        crc, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        body = data[pos + CHUNK_HEADER.size: pos + CHUNK_HEADER.size + length]
        if len(body) < length or zlib.crc32(bytes([kind]) + body) != crc:
            return
        pos += CHUNK_HEADER.size + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + body)
            pending = b""
            yield record
        elif kind in (FIRST, MIDDLE):
            pending = (pending if kind == MIDDLE else b"") + body
        else:
            return


def history_rows(path: Path) -> list[dict[str, Any]]:
    """Each history row of the log: its values by key, `_step` included."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            row["_step"] = record.history.step.num
            rows.append(row)
    return rows


def run_logs(wandb_dir: Path, run_id: str) -> list[Path]:
    """The transaction logs of run `run_id` under `wandb_dir` (W&B's `dir`), one per start of the run, oldest
    first (the run directories are named `[offline-]run-YYYYMMDD_HHMMSS-<id>`)."""
    logs = [p for p in (wandb_dir / "wandb").glob(f"*/run-{run_id}.wandb") if not p.parent.is_symlink()]
    return sorted(logs, key=lambda p: p.parent.name.removeprefix("offline-"))
