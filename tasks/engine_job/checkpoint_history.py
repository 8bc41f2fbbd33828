"""The run's history file travels with the checkpoints committed to storage.

The engine keeps a run's metrics history in one append-only file beside its checkpoint directories, and each
checkpoint names its prefix of that file (vime_engine/checkpoint/run_history.py). In storage the file lies beside the
committed checkpoints too, `{run}/checkpoints/history.jsonl`: uploaded before a checkpoint's commit (so a
committed checkpoint always finds its lines), brought down beside a checkpoint fetched to another machine, and
read with a checkpoint's driver.json where the whole history is needed (the report).

The object only grows along one run: an upload that storage already holds as a prefix (a later checkpoint's
upload) is skipped, so committing an older checkpoint again never cuts lines a newer one needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.storage import NotFoundError, Storage, join_key, open_storage
from vime_engine.checkpoint import store as ckpt
from vime_engine.checkpoint.run_history import HISTORY_FILE, MARK_KEY, HistoryMark, read_checked, saved_records


def history_key(checkpoint_key: str) -> str:
    """The history object beside the checkpoint committed at `checkpoint_key`."""
    parent = checkpoint_key.strip("/").rpartition("/")[0]
    return join_key(parent, HISTORY_FILE)


def open_checkpoint(checkpoint_uri: str) -> tuple[Storage, str]:
    """The storage holding a committed checkpoint and its history, and the checkpoint's key there."""
    parent, _, name = checkpoint_uri.rstrip("/").rpartition("/")
    return open_storage(parent), name


def _get(storage: Storage, key: str) -> bytes | None:
    try:
        return storage.get_bytes(key)
    except NotFoundError:
        return None


def upload_history(root: Storage, checkpoint_key: str, found: ckpt.CheckpointRef) -> None:
    """Before committing `found` at `checkpoint_key`: the history lines it names, checked, beside it."""
    state = found.driver_state()
    if MARK_KEY not in state:  # a checkpoint of the old layout carries its history in driver.json
        return
    data = read_checked(found.path.parent / HISTORY_FILE, HistoryMark.from_json(state[MARK_KEY]))
    key = history_key(checkpoint_key)
    held = _get(root, key)
    if held is not None and held.startswith(data):
        return
    root.put_bytes(key, data)


def fetch_history(root: Storage, checkpoint_key: str, local_root: Path) -> None:
    """After fetching the checkpoint at `checkpoint_key` into `local_root`: the history file beside it.

    A local file that already extends what storage holds is kept; without a history object (checkpoints of the
    old layout) nothing is fetched, and a checkpoint that needs the file says so when it is loaded."""
    data = _get(root, history_key(checkpoint_key))
    path = Path(local_root) / HISTORY_FILE
    if data is None or (path.is_file() and path.read_bytes().startswith(data)):
        return
    ckpt.write_atomic(path, data)


def read_history(checkpoint_uri: str) -> list[dict[str, Any]]:
    """The whole metrics history of the committed checkpoint at `checkpoint_uri` (its prefix of the file)."""
    storage, key = open_checkpoint(checkpoint_uri)
    state = json.loads(storage.get_bytes(join_key(key, ckpt.DRIVER_STATE)))
    history = history_key(key)
    return saved_records(state, lambda: storage.get_bytes(history), storage.uri(history))
