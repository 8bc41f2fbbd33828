"""The directory manifest: every file's size, sha256 and xxh3-128, written last.

Format (engine checkpoints and committed storage prefixes)::

    {"version": 1,
     "files": {"<posix relpath>": {"size": <int>, "sha256": "<hex>", "xxh3_128": "<hex>"}},
     "created": "<ISO-8601 UTC>",
     "meta": {...free-form...}}

A prefix (or directory) is trusted only when its ``manifest.json`` parses and every file it lists is present
with that size and checksum. The sha256 is the content address (cache keys, lineage, storage checks); the
xxh3-128 is the check a load runs (about 20x faster than sha256), computed in the same pass as the sha256.
Manifests written before it existed have no ``xxh3_128`` and are checked by their sha256. The "manifest hash"
is the sha256 of the exact bytes of ``manifest.json`` as written; it names a committed tree.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import xxhash

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str
    xxh3_128: str | None = None  # None in manifests written before the fast checksum existed


class _Hash(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


class _FileHashes:
    """Both checksums of one stream of bytes, fed in order (a file read once for its manifest entry)."""

    def __init__(self) -> None:
        self.sha256 = hashlib.sha256()
        self.xxh3_128 = xxhash.xxh3_128()
        self.size = 0

    def update(self, data: bytes | memoryview) -> None:
        self.sha256.update(data)
        self.xxh3_128.update(data)
        self.size += len(data)

    def entry(self) -> FileEntry:
        return FileEntry(self.size, self.sha256.hexdigest(), self.xxh3_128.hexdigest())


@dataclass(frozen=True)
class LoadCheck:
    """The hash a load runs over a file's bytes and the digest they must reach."""

    name: str
    hash: _Hash
    expected: str

    @classmethod
    def for_entry(cls, entry: FileEntry) -> "LoadCheck":
        """xxh3-128 when the entry records it, else sha256 (manifests from before the fast checksum)."""
        if entry.xxh3_128 is not None:
            return cls("xxh3_128", xxhash.xxh3_128(), entry.xxh3_128)
        return cls("sha256", hashlib.sha256(), entry.sha256)

    def matches(self) -> bool:
        return self.hash.hexdigest() == self.expected


@dataclass(frozen=True)
class FileDigest:
    """What one read of a local file yields: its manifest entry plus the MD5 of each upload part.

    ``part_md5s`` holds one hex MD5 per ``part_size`` slice (one entry for a single-request upload); object
    stores derive their ETags from them, so uploads and their verification need no second read.
    """

    size: int
    sha256: str
    part_size: int
    part_md5s: tuple[str, ...]
    xxh3_128: str | None = None

    @property
    def entry(self) -> FileEntry:
        return FileEntry(self.size, self.sha256, self.xxh3_128)

    def expected_etag(self, multipart: bool) -> str:
        """S3/OBS ETag for this content: md5 for one PUT, md5(concat(part md5s))-N for a multipart upload."""
        if not multipart:
            return self.part_md5s[0]
        joined = b"".join(bytes.fromhex(m) for m in self.part_md5s)
        return f"{hashlib.md5(joined).hexdigest()}-{len(self.part_md5s)}"


@dataclass(frozen=True)
class Manifest:
    files: dict[str, FileEntry]
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = MANIFEST_VERSION

    def to_bytes(self) -> bytes:
        """Canonical bytes (sorted keys) so the same tree and meta always hash the same."""
        doc = {
            "version": self.version,
            "files": {k: _entry_doc(v) for k, v in sorted(self.files.items())},
            "created": self.created,
            "meta": self.meta,
        }
        return (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        """Parse and validate; raises ValueError on anything that is not a version-1 manifest."""
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("version") != MANIFEST_VERSION:
            raise ValueError(f"unsupported manifest version: {doc.get('version') if isinstance(doc, dict) else doc!r}")
        files = {}
        for rel, e in doc["files"].items():
            fast = e.get("xxh3_128")
            if (not isinstance(e.get("size"), int) or not _is_hex(e.get("sha256"), 64)
                    or (fast is not None and not _is_hex(fast, 32))):
                raise ValueError(f"bad manifest entry for {rel!r}")
            files[check_relpath(rel)] = FileEntry(e["size"], e["sha256"], fast)
        return cls(files=files, created=str(doc.get("created", "")), meta=dict(doc.get("meta") or {}))


def _entry_doc(entry: FileEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"size": entry.size, "sha256": entry.sha256}
    if entry.xxh3_128 is not None:
        doc["xxh3_128"] = entry.xxh3_128
    return doc


def _is_hex(value: object, length: int) -> bool:
    return isinstance(value, str) and len(value) == length and all(c in "0123456789abcdef" for c in value)


def check_relpath(rel: str) -> str:
    """Reject paths that could escape the tree when joined to a local directory."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in rel:
        raise ValueError(f"unsafe path in manifest: {rel!r}")
    return rel


def part_size_for(size: int, min_part: int = 8 << 20, max_parts: int = 10_000) -> int:
    """Deterministic part size: ``min_part``, grown in MiB steps to keep under ``max_parts`` parts.

    Determinism matters: a resumed upload must cut the file exactly as the interrupted one did.
    """
    need = -(-size // max_parts)
    return max(min_part, -(-need // (1 << 20)) * (1 << 20))


def digest_file(path: Path, part_size: int, part_md5s: bool = True) -> FileDigest:
    """One sequential read: the file's checksums and the md5 of every ``part_size`` slice.

    Without ``part_md5s`` (stores without ETags) no md5 is computed: it is the slowest of the hashes.
    """
    if not part_md5s:
        entry = file_entry(Path(path))
        return FileDigest(entry.size, entry.sha256, part_size, (), entry.xxh3_128)
    hashes = _FileHashes()
    md5s: list[str] = []
    with open(path, "rb") as f:
        while True:
            part = hashlib.md5()
            left = part_size
            while left:
                chunk = f.read(min(_READ_CHUNK, left))
                if not chunk:
                    break
                hashes.update(chunk)
                part.update(chunk)
                left -= len(chunk)
            if left == part_size and md5s:
                break
            md5s.append(part.hexdigest())
            if left:
                break
    entry = hashes.entry()
    return FileDigest(entry.size, entry.sha256, part_size, tuple(md5s), entry.xxh3_128)


def sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def file_entry(path: Path) -> FileEntry:
    """Size and both checksums of a file, in one read."""
    hashes = _FileHashes()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            hashes.update(chunk)
    return hashes.entry()


def file_matches(path: Path, entry: FileEntry) -> bool:
    """Whether the file has the entry's size and bytes (by its load check: xxh3-128 when recorded)."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size != entry.size:
        return False
    check = LoadCheck.for_entry(entry)
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            check.hash.update(chunk)
    return check.matches()


def list_tree(local_dir: Path) -> dict[str, Path]:
    """Regular files under ``local_dir`` by posix relpath, excluding a top-level manifest.json."""
    local_dir = Path(local_dir)
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(local_dir):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            rel = p.relative_to(local_dir).as_posix()
            if rel != MANIFEST_NAME and p.is_file():
                out[rel] = p
    return out


def digest_tree(local_dir: Path, digest: Callable[[Path], FileDigest], workers: int = 4) -> dict[str, FileDigest]:
    """`digest` of every file of the tree, in parallel (hashlib releases the GIL on large updates)."""
    files = list_tree(local_dir)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(files.keys(), pool.map(digest, files.values())))


def build_manifest(local_dir: Path, meta: dict[str, Any] | None = None,
                   known: dict[str, FileEntry] | None = None) -> Manifest:
    """The manifest of `local_dir`; files in `known` (hashed as they were written) are not read again."""
    known = known or {}
    files = list_tree(local_dir)
    if set(known) - set(files):
        raise ValueError(f"{local_dir}: no such files to take digests for: {sorted(set(known) - set(files))}")
    todo = [rel for rel in files if rel not in known]
    with ThreadPoolExecutor(max_workers=4) as pool:
        hashed = dict(zip(todo, pool.map(lambda rel: file_entry(files[rel]), todo)))
    return Manifest(files={**hashed, **known}, meta=dict(meta or {}))


class ChecksumMismatch(ValueError):
    """A file's bytes do not match the size or checksum its manifest entry records."""


def read_verified(path: Path, expected: FileEntry) -> bytes:
    """The file's bytes, after checking them against `expected` (ChecksumMismatch naming the file if not)."""
    data = Path(path).read_bytes()
    check = LoadCheck.for_entry(expected)
    check.hash.update(data)
    if len(data) != expected.size or not check.matches():
        raise ChecksumMismatch(f"{path}: bytes differ from the manifest's {check.name} (the file is corrupt)")
    return data


def verify_local_tree(local_dir: Path, files: Mapping[str, FileEntry], content: bool = True) -> list[str]:
    """Relpaths whose local file is missing or differs from its entry (empty list: the tree matches).

    `content=False` compares sizes only (the checksum is then checked by whoever reads the files).
    """
    bad = []
    for rel, entry in sorted(files.items()):
        p = Path(local_dir) / rel
        if not p.is_file() or p.stat().st_size != entry.size or (content and not file_matches(p, entry)):
            bad.append(rel)
    return bad
