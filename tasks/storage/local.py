"""``file://`` roots: a directory on this machine."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from vime_engine.checkpoint.manifest import FileDigest, check_relpath
from tasks.storage.base import ObjectInfo, Storage, join_key
from tasks.storage.errors import NotFoundError, PermanentStorageError


class LocalStorage(Storage):
    """``file://`` roots: a directory. Writes go to a temporary name and are renamed into place."""

    etags = False

    def __init__(self, root: Path, max_concurrency: int = 8):
        self.root = Path(root).resolve()
        self.root_uri = self.root.as_uri()
        self.max_concurrency = max_concurrency

    def _rebase(self, prefix: str) -> None:
        self.root = self.root / join_key(prefix)
        self.root_uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        key = join_key(key)
        return self.root / check_relpath(key) if key else self.root

    def _put_file(self, local: Path, key: str, digest: FileDigest) -> None:
        self._write(key, lambda tmp: shutil.copyfile(local, tmp))

    def _write(self, key: str, fill) -> None:
        dest = self._path(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
            fill(tmp)
            os.replace(tmp, dest)
        except OSError as exc:
            raise PermanentStorageError("put", self.uri(key), message=exc.strerror or str(exc)) from None

    def _get_file(self, key: str, local: Path, size: int | None) -> None:
        src = self._path(key)
        if not src.is_file():
            raise NotFoundError("get", self.uri(key), code="NoSuchKey")
        shutil.copyfile(src, local)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        out = []
        if not self.root.is_dir():
            return out
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                p = Path(dirpath) / name
                key = p.relative_to(self.root).as_posix()
                if key.startswith(prefix) and not name.endswith(".tmp"):
                    out.append(ObjectInfo(key, p.stat().st_size, None))
        return sorted(out, key=lambda o: o.key)

    def _head(self, key: str) -> ObjectInfo | None:
        p = self._path(key)
        return ObjectInfo(join_key(key), p.stat().st_size, None) if p.is_file() else None

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write(key, lambda tmp: tmp.write_bytes(data))

    def _create_bytes(self, key: str, data: bytes) -> bool:
        dest = self._path(key)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.link(tmp, dest)  # whole or not at all, and never over an existing file
        except FileExistsError:
            return False
        except OSError as exc:
            raise PermanentStorageError("create", self.uri(key), message=exc.strerror or str(exc)) from None
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def get_bytes(self, key: str) -> bytes:
        p = self._path(key)
        if not p.is_file():
            raise NotFoundError("get", self.uri(key), code="NoSuchKey")
        return p.read_bytes()

    def check_root(self) -> None:
        existing = next(p for p in (self.root, *self.root.parents) if p.exists())
        if not existing.is_dir():
            raise PermanentStorageError("check", self.uri(), code="NotADirectory",
                                        message=f"{existing} is a file, so no directory can be made under it")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermanentStorageError("check", self.uri(), code="AccessDenied",
                                        message=f"{existing} is not writable by this user")

    def _delete_keys(self, keys: list[str]) -> None:
        for k in keys:
            self._path(k).unlink(missing_ok=True)
