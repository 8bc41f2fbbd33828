"""The resumable checkpoint: rollout directories committed in a crash-safe order, and finding the newest valid one.

Layout under the checkpoint root:

    rollout_0000007/
        model.safetensors, trainer.*      written by the training backend (weights; optimizer, scheduler, RNG)
        driver.json                       data cursor, weight version, config and its hash, and the mark of
                                          the metrics history: its first N lines (bytes, sha256) in history.jsonl
        buffer.pkl                        samples carried over to the next rollout (dynamic sampling)
        manifest.json                     written last: every file's size, sha256 and xxh3-128
    LATEST                                "rollout_0000007", replaced atomically after the manifest is on disk
    history.jsonl                         the run's metrics history, append-only, fsynced before each manifest;
                                          each checkpoint reads only its own prefix (vime_engine/checkpoint/run_history.py)

A directory without a valid manifest is not a checkpoint. `find_latest` walks back from LATEST (or the newest
directory) to the newest checkpoint whose files match their manifest and says which it skipped and why.

Checking a checksum costs a full read, so the resume path does it in the read that loads the files:
`candidates` yields checkpoints whose manifest and file sizes are right, and the loader checks each file as
it reads it (a mismatch raises CheckpointError and the next candidate is tried). Loads check the xxh3-128
(about 20x faster than sha256); the sha256 stays the content address, and manifests written before the fast
checksum existed are checked by it. Likewise the backend returns the digests it computed while writing, and
`commit` hashes only the other files.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime_engine.checkpoint.manifest import (
    MANIFEST_NAME, ChecksumMismatch, FileEntry, Manifest, build_manifest, read_verified, verify_local_tree,
)

log = logging.getLogger(__name__)

LATEST = "LATEST"
DRIVER_STATE = "driver.json"
_DIR_RE = re.compile(r"^rollout_(\d{7})$")


class CheckpointError(RuntimeError):
    pass


def checkpoint_dir(root: Path, rollout_id: int) -> Path:
    return Path(root) / f"rollout_{rollout_id:07d}"


@dataclass(frozen=True)
class CheckpointRef:
    path: Path
    rollout_id: int
    manifest: Manifest

    @property
    def manifest_hash(self) -> str:
        return self.manifest.hash

    def read_verified(self, rel: str) -> bytes:
        """One file's bytes, checked against the manifest (CheckpointError naming the file if they differ)."""
        try:
            return read_verified(self.path / rel, self.manifest.files[rel])
        except (ChecksumMismatch, KeyError, OSError) as exc:
            raise CheckpointError(f"{self.path}: {rel}: {exc}") from None

    def driver_state(self) -> dict[str, Any]:
        return json.loads(self.read_verified(DRIVER_STATE))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def staging_dir(root: Path, rollout_id: int) -> Path:
    """A fresh directory to write a checkpoint's files into before `commit` makes it a checkpoint."""
    staged = Path(root) / f".rollout_{rollout_id:07d}.partial-{os.getpid()}"
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    return staged


def discard_staged(root: Path | str) -> None:
    """Remove this process's unfinished saves under `root` (`staging_dir`'s directories): a run that ends while a
    save is under way leaves no half-written directory beside its checkpoints."""
    for staged in Path(root).glob(f".rollout_*.partial-{os.getpid()}"):
        shutil.rmtree(staged, ignore_errors=True)


def commit(root: Path, staged: Path, rollout_id: int, driver_state: dict[str, Any], keep_last: int | None,
           written: dict[str, FileEntry] | None = None) -> CheckpointRef:
    """Write driver state, fsync, write the manifest, move into place, then move LATEST.

    `written`: entries of files already fsynced and hashed while they were written (not read again).
    """
    root = Path(root)
    written = dict(written or {})
    (staged / DRIVER_STATE).write_text(json.dumps(driver_state, sort_keys=True, indent=1))
    for f in staged.rglob("*"):
        if f.is_file() and f.relative_to(staged).as_posix() not in written:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    manifest = build_manifest(staged, meta={"rollout_id": rollout_id}, known=written)
    write_atomic(staged / MANIFEST_NAME, manifest.to_bytes())
    final = checkpoint_dir(root, rollout_id)
    if final.exists():  # an invalid leftover of an earlier attempt at this rollout
        shutil.rmtree(final)
    os.replace(staged, final)
    _fsync_dir(root)
    write_atomic(root / LATEST, final.name.encode())
    if keep_last:
        _prune(root, keep_last)
    return CheckpointRef(final, rollout_id, manifest)


def _prune(root: Path, keep_last: int) -> None:
    ids = sorted(_rollout_ids(root))
    for old in ids[:-keep_last]:
        shutil.rmtree(checkpoint_dir(root, old), ignore_errors=True)


def _rollout_ids(root: Path) -> list[int]:
    if not Path(root).is_dir():
        return []
    return [int(m.group(1)) for p in Path(root).iterdir() if (m := _DIR_RE.match(p.name)) and p.is_dir()]


def validate(path: Path, content: bool = True) -> CheckpointRef:
    """The checkpoint at `path`, or CheckpointError saying why it is not one.

    `content=False` checks the manifest and every file's presence and size but not its checksum (for callers
    that only need to know how far a run got, or that check the hashes as they read the files).
    """
    m = _DIR_RE.match(path.name)
    if not m:
        raise CheckpointError(f"{path}: not a rollout_NNNNNNN directory")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST_NAME} (the save did not finish)")
    try:
        manifest = Manifest.from_bytes(manifest_path.read_bytes())
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{path}: unreadable {MANIFEST_NAME}: {exc}") from None
    bad = verify_local_tree(path, manifest.files, content)
    if bad:
        raise CheckpointError(f"{path}: files missing or not matching the manifest: {', '.join(bad)}")
    return CheckpointRef(path, int(m.group(1)), manifest)


def candidates(root: Path | str | None, content: bool = False) -> Iterator[CheckpointRef]:
    """Valid checkpoints under `root`, newest first (LATEST first), reporting each one skipped and why."""
    if root is None or not Path(root).is_dir():
        return
    root = Path(root)
    ids = sorted(_rollout_ids(root), reverse=True)
    pointer = root / LATEST
    dangling = None  # what LATEST names when that is not a checkpoint directory here
    if pointer.is_file():
        named = pointer.read_text(errors="replace").strip()
        m = _DIR_RE.match(named)
        if m and int(m.group(1)) in ids:  # LATEST first; newer unpointed dirs are unfinished saves
            latest = int(m.group(1))
            ids = [latest] + [i for i in ids if i < latest]
        else:
            dangling = named
    for rollout_id in ids:
        try:
            found = validate(checkpoint_dir(root, rollout_id), content)
        except CheckpointError as exc:
            log.warning("skipping checkpoint: %s", exc)
            continue
        if dangling is not None:
            log.warning("%s names %r, which is not a checkpoint directory there; using the newest checkpoint, %s, "
                        "instead", pointer, dangling[:80], found.path.name)
            dangling = None
        yield found


def find_latest(root: Path | str | None, content: bool = True) -> CheckpointRef | None:
    """The newest valid checkpoint under `root` (None if there is none), reporting any it had to skip."""
    return next(candidates(root, content), None)
