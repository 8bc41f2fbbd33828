"""One writer per checkpoint directory: a run holds an exclusive `flock` on `LOCK_FILE` in its `--save` directory.

Two runs started on one `--save` (by hand, or two attempts of one pipeline chunk) wrote the same checkpoints and
read each other's half-written files (the second died on a `UnicodeDecodeError` in them). `flock` is released by
the kernel when the holding process ends, however it ends (SIGKILL, the OOM killer), so no crash leaves a stale
lock behind and nothing needs to be cleaned up by hand. The holder writes its pid and host into the file, so the
refused run names who holds it. A lock only excludes processes that take it: every run takes it where it starts
(vime_engine/runtime/driver.py), before Ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from vime_engine.checkpoint.store import discard_staged
from vime_engine.config.errors import ConfigError

LOCK_FILE = ".vimeflow.lock"


class CheckpointDirLocked(ConfigError):
    """Another live run holds the checkpoint directory: retrying cannot help until it ends."""


def holder_record(pid: int, host: str) -> bytes:
    """What a holder writes into the lock file: its pid and host, as JSON."""
    return json.dumps({"pid": pid, "host": host}).encode()


def describe_holder(record: bytes) -> str:
    """The holder named from its lock file ("pid 123 on host gpu-7"); a record being written, or from another
    program, reads as an unknown one."""
    try:
        holder = json.loads(record)
        return f"pid {int(holder['pid'])} on host {holder['host']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"


@contextlib.contextmanager
def exclusive_writer(directory: str | Path, flag: str = "--save") -> Iterator[None]:
    """Hold `directory` (made if missing) for this process for the block, or refuse at once with
    CheckpointDirLocked naming the holder. A directory this run made and left holding nothing but the lock is
    removed again."""
    root = Path(directory)
    made = not root.exists()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag} {root}: cannot create the checkpoint directory ({exc.strerror}); "
                          "give a directory this user can write") from None
    fd = _locked(root / LOCK_FILE, flag)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder_record(os.getpid(), socket.gethostname()), 0)
        yield
    finally:
        discard_staged(root)  # a save this run did not finish (its workers are gone by now)
        if [p.name for p in root.iterdir()] == [LOCK_FILE]:  # still held: nobody else can be starting in it
            os.unlink(root / LOCK_FILE)
            if made:
                root.rmdir()
        os.close(fd)  # the lock goes with the descriptor


def _locked(path: Path, flag: str) -> int:
    """A descriptor of `path` holding its exclusive flock. If the file was unlinked between our open and our lock
    (a holder ending, see above), the lock is on a name no one else sees: take the new file's instead."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(os.pread(fd, 4096, 0))
            os.close(fd)
            raise CheckpointDirLocked(
                f"{flag} {path.parent} is in use by another run ({holder}; {path.name} holds the lock): wait for it "
                f"to end, or give this run another {flag} directory") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
