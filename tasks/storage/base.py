"""The storage interface every backend implements, and the tree operations built on it.

A ``Storage`` is rooted at a URI; every key it takes is relative to that root. Backends implement a few
primitives (put/get of one object, list, head, delete); this module builds the tree operations on top:
parallel ``put_tree`` / ``get_tree``, and the committed-tree contract:

``commit_tree``: drop any old manifest (the prefix stops being trusted), upload every file (skipping objects
that already hold the same bytes), verify the listing against local sizes and ETags, then write
``manifest.json`` last. ``fetch_tree``: read the manifest (no manifest, no tree), download what is missing
locally, verify every sha256, and write the manifest locally too.
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime_engine.checkpoint.manifest import (
    MANIFEST_NAME, FileDigest, Manifest, check_relpath, digest_file, digest_tree, list_tree, part_size_for,
    sha256_file,
)
from tasks.storage.errors import (
    MISSING_BUCKET, IntegrityError, NotFoundError, PermanentStorageError, with_retries,
)

log = logging.getLogger("vimeflow.storage")


@dataclass(frozen=True)
class TreeUpload:
    digests: dict[str, FileDigest]  # every file of the tree
    uploaded: list[str]  # the relpaths actually sent (the rest already matched)


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the storage root
    size: int
    etag: str | None  # S3/OBS ETag without quotes; None where the backend has none (file://)


def join_key(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def dir_prefix(prefix: str) -> str:
    """``prefix`` as a directory for listing: "a/b" -> "a/b/", "" -> "" (the whole root)."""
    p = join_key(prefix)
    return p + "/" if p else ""


class Storage(ABC):
    """Common tree logic over backend primitives. Subclasses set ``root_uri`` and implement the primitives."""

    root_uri: str
    max_concurrency: int = 8
    multipart_threshold: int = 8 << 20
    max_attempts: int = 5
    retry_base_delay: float = 0.2
    etags: bool = True  # objects carry MD5-based ETags (S3, OBS): uploads send and check part MD5s

    # ---- primitives (keys relative to the root) -----------------------------------------------------------
    @abstractmethod
    def _put_file(self, local: Path, key: str, digest: FileDigest) -> None:
        """Upload one file whose digest is known (multipart above ``multipart_threshold``)."""

    @abstractmethod
    def _get_file(self, key: str, local: Path, size: int | None) -> None:
        """Download one object to ``local`` (overwritten)."""

    @abstractmethod
    def _list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a plain string prefix)."""

    @abstractmethod
    def _head(self, key: str) -> ObjectInfo | None:
        """The object's info, or None when it does not exist."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def _create_bytes(self, key: str, data: bytes) -> bool:
        """Write the object only where no object has `key`, decided by the service in the one request (S3's
        If-None-Match, OBS's forbid-overwrite, a hard link); False when one has it."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Raises NotFoundError when the object does not exist."""

    @abstractmethod
    def _delete_keys(self, keys: list[str]) -> None: ...

    @abstractmethod
    def check_root(self) -> None:
        """Raise PermanentStorageError, in one request, where the root cannot be used at all: a bucket that does not
        exist, credentials the service refuses, a directory that cannot be made. (Rights to write are not probed.)"""

    # ---- small helpers ------------------------------------------------------------------------------------
    def uri(self, key: str = "") -> str:
        return self.root_uri.rstrip("/") + ("/" + key.strip("/") if key.strip("/") else "")

    def child(self, prefix: str) -> "Storage":
        """A storage rooted at ``prefix`` under this one (same client and settings)."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._rebase(prefix)
        return clone

    @abstractmethod
    def _rebase(self, prefix: str) -> None: ...

    def _retry(self, fn):
        return with_retries(fn, attempts=self.max_attempts, base_delay=self.retry_base_delay)

    # ---- single objects -----------------------------------------------------------------------------------
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self._retry(lambda: self._list(prefix))

    def exists(self, key: str) -> bool:
        return self._retry(lambda: self._head(key)) is not None

    def delete(self, keys: list[str]) -> None:
        """Delete these objects (a missing one is no error)."""
        if keys:
            self._retry(lambda: self._delete_keys(keys))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix`` (a directory-like prefix); returns how many."""
        keys = [o.key for o in self.list(dir_prefix(prefix))]
        self.delete(keys)
        return len(keys)

    def create_bytes(self, key: str, data: bytes) -> bool:
        """Create `key` with `data` unless an object has it (then False, the object untouched). A retried request
        whose first attempt landed reads as False too: a caller that must know writes something of its own in
        `data` and reads it back."""
        return self._retry(lambda: self._create_bytes(key, data))

    def read_json(self, key: str) -> Any:
        return json.loads(self._retry(lambda: self.get_bytes(key)))

    def write_json(self, key: str, value: Any) -> None:
        data = (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()
        self._retry(lambda: self.put_bytes(key, data))

    # ---- trees --------------------------------------------------------------------------------------------
    def digest(self, local: Path) -> FileDigest:
        """What uploading `local` here needs to know: size, sha256 and (where ETags exist) the part MD5s."""
        return digest_file(local, part_size_for(local.stat().st_size, self.multipart_threshold),
                           part_md5s=self.etags)

    def digest_tree(self, local_dir: Path) -> dict[str, FileDigest]:
        """Digests of every file, cut into this storage's part size (what commit_tree would compute)."""
        return digest_tree(Path(local_dir), self.digest)

    def put_tree(self, local_dir: Path, prefix: str, digests: dict[str, FileDigest] | None = None,
                 skip_existing: bool = False) -> TreeUpload:
        """Upload every file under ``local_dir`` to ``prefix/relpath`` in parallel.

        Each worker digests its file (one read: sha256 + part MD5s) and uploads it, so hashing overlaps the
        network; largest files start first. With ``skip_existing``, objects that already have the file's
        size and ETag are left alone (a re-run of an interrupted upload sends only what is missing).
        """
        local_dir = Path(local_dir)
        files = list_tree(local_dir)
        remote = {o.key: o for o in self.list(dir_prefix(prefix))} if skip_existing else {}

        def one(rel: str, path: Path) -> tuple[FileDigest, bool]:
            d = digests[rel] if digests else self.digest(path)
            key = join_key(prefix, rel)
            if skip_existing and self._object_matches(remote.get(key), d):
                return d, False
            self._put_file(path, key, d)
            return d, True

        order = sorted(files, key=lambda r: -files[r].stat().st_size)
        with ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="put") as pool:
            futures = {rel: pool.submit(one, rel, files[rel]) for rel in order}
            done = {rel: f.result() for rel, f in futures.items()}
        return TreeUpload(digests={rel: done[rel][0] for rel in sorted(done)},
                          uploaded=sorted(rel for rel, (_, sent) in done.items() if sent))

    def get_tree(self, prefix: str, local_dir: Path) -> list[str]:
        """Download every object under ``prefix`` into ``local_dir`` (no manifest check); returns relpaths."""
        base = join_key(prefix)
        objs = self.list(dir_prefix(base))
        rels = {o.key[len(base) + 1 if base else 0:]: o for o in objs}
        self._download_many({check_relpath(r): (o.key, o.size) for r, o in rels.items()}, Path(local_dir))
        return sorted(rels)

    def _download_many(self, items: dict[str, tuple[str, int | None]], local_dir: Path) -> None:
        def one(rel: str, key: str, size: int | None) -> None:
            dest = local_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            self._get_file(key, dest, size)

        with ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="get") as pool:
            futures = [pool.submit(one, rel, key, size) for rel, (key, size) in items.items()]
            for f in futures:
                f.result()

    def _object_matches(self, obj: ObjectInfo | None, d: FileDigest) -> bool:
        if obj is None or obj.size != d.size:
            return False
        if obj.etag is None:
            return True
        return obj.etag in (d.expected_etag(False), d.expected_etag(True))

    def commit_tree(self, local_dir: Path, prefix: str, meta: dict[str, Any] | None = None,
                    digests: dict[str, FileDigest] | None = None) -> Manifest:
        """Upload, verify, then write the manifest last. Returns the manifest written."""
        local_dir = Path(local_dir)
        manifest_key = join_key(prefix, MANIFEST_NAME)
        # Unconditional (deleting a missing key succeeds): one request, and a refusal comes with an error body.
        self._retry(lambda: self._delete_keys([manifest_key]))
        result = self.put_tree(local_dir, prefix, digests, skip_existing=True)
        digests, uploaded = result.digests, result.uploaded
        remote = {o.key: o for o in self.list(dir_prefix(prefix))}
        bad = [rel for rel, d in digests.items() if not self._object_matches(remote.get(join_key(prefix, rel)), d)]
        if bad:
            raise IntegrityError("commit_tree", self.uri(prefix),
                                 message=f"{len(bad)} object(s) missing or different after upload: {bad[:5]}")
        manifest = Manifest(files={rel: d.entry for rel, d in digests.items()}, meta=dict(meta or {}))
        self._retry(lambda: self.put_bytes(manifest_key, manifest.to_bytes()))
        log.info("committed %s: %d files (%d uploaded), manifest %s", self.uri(prefix), len(digests),
                 len(uploaded), manifest.hash[:12])
        return manifest

    def read_manifest(self, prefix: str) -> tuple[Manifest, bytes]:
        """The committed tree's manifest and its raw bytes; NotFoundError when the prefix is not committed."""
        key = join_key(prefix, MANIFEST_NAME)
        try:
            raw = self._retry(lambda: self.get_bytes(key))
        except NotFoundError as exc:
            if exc.code == "NoSuchBucket":  # not "nothing committed yet": nothing can be written there either
                raise PermanentStorageError("read_manifest", self.uri(prefix), status=exc.status, code=exc.code,
                                            message=MISSING_BUCKET) from None
            raise NotFoundError("read_manifest", self.uri(prefix), status=exc.status, code=exc.code,
                                message="no manifest.json: the tree is not committed (or not complete)") from None
        try:
            return Manifest.from_bytes(raw), raw
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError("read_manifest", self.uri(key), message=f"invalid manifest: {exc}") from None

    def fetch_tree(self, prefix: str, local_dir: Path) -> Manifest:
        """Bring a committed tree down, verified. Files already present with the right sha256 are kept."""
        local_dir = Path(local_dir)
        manifest, raw = self.read_manifest(prefix)
        todo = {rel: (join_key(prefix, rel), e.size) for rel, e in manifest.files.items()
                if not _local_matches(local_dir / rel, e.size, e.sha256)}
        for attempt in (1, 2):
            self._download_many(todo, local_dir)
            todo = {rel: v for rel, v in todo.items()
                    if not _local_matches(local_dir / rel, manifest.files[rel].size, manifest.files[rel].sha256)}
            if not todo:
                break
            log.warning("checksum mismatch after download (attempt %d): %s", attempt, sorted(todo)[:5])
        if todo:
            raise IntegrityError("fetch_tree", self.uri(prefix),
                                 message=f"sha256 mismatch for {len(todo)} file(s): {sorted(todo)[:5]}")
        (local_dir / MANIFEST_NAME).write_bytes(raw)
        return manifest


def _local_matches(path: Path, size: int, sha256: str) -> bool:
    return path.is_file() and path.stat().st_size == size and sha256_file(path) == sha256
