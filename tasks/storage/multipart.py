"""Resumable multipart upload, shared by the S3 and OBS backends.

Resumption state lives on the server, not in a local checkpoint file, so a re-run on another machine (a new
ModelArts container) resumes too:

1. cut the file into parts of ``digest.part_size`` (deterministic for a given file size);
2. find the newest unfinished upload for the key; keep every listed part whose size and ETag equal the local
   part's size and MD5 (the ETag of a part is its MD5 on S3 and OBS), abort the other stale uploads;
3. upload only the missing parts, in parallel, each with Content-MD5 and its own retries;
4. complete with all parts in order.

An upload that fails is *not* aborted: its finished parts are what the next attempt reuses. Buckets should
carry a lifecycle rule that expires incomplete multipart uploads after a few days.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from vime_engine.checkpoint.manifest import FileDigest

log = logging.getLogger("vimeflow.storage")


@dataclass(frozen=True)
class PartInfo:
    size: int
    etag: str


class MultipartApi(Protocol):
    """The five calls a backend provides; each raises a typed StorageError on failure."""

    def mpu_find(self, key: str) -> list[str]:
        """Upload ids of unfinished uploads for exactly ``key``, newest first."""

    def mpu_list_parts(self, key: str, upload_id: str) -> dict[int, PartInfo]: ...

    def mpu_create(self, key: str) -> str: ...

    def mpu_upload_part(self, key: str, upload_id: str, number: int, body: bytes, md5_b64: str) -> str:
        """Returns the part's ETag (without quotes)."""

    def mpu_complete(self, key: str, upload_id: str, etags: list[tuple[int, str]]) -> None: ...

    def mpu_abort(self, key: str, upload_id: str) -> None: ...


@dataclass(frozen=True)
class MultipartResult:
    upload_id: str
    parts_total: int
    parts_reused: int


def md5_b64(hex_md5: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_md5)).decode()


def _reusable_parts(listed: dict[int, PartInfo], digest: FileDigest) -> dict[int, str]:
    keep = {}
    for number, info in listed.items():
        idx = number - 1
        if 0 <= idx < len(digest.part_md5s) and info.etag.strip('"') == digest.part_md5s[idx] \
                and info.size == _part_len(digest, idx):
            keep[number] = digest.part_md5s[idx]
    return keep


def _part_len(digest: FileDigest, idx: int) -> int:
    return min(digest.part_size, digest.size - idx * digest.part_size)


def upload_resumable(api: MultipartApi, local: Path, key: str, digest: FileDigest, pool: Executor,
                     retry: Callable) -> MultipartResult:
    """Upload ``local`` to ``key`` as a multipart upload, reusing parts of an interrupted one."""
    upload_id, done = None, {}
    for i, candidate in enumerate(retry(lambda: api.mpu_find(key))):
        if upload_id is None:
            done = _reusable_parts(retry(lambda: api.mpu_list_parts(key, candidate)), digest)
            if done:
                upload_id = candidate
                continue
        retry(lambda: api.mpu_abort(key, candidate))  # stale: other content or nothing reusable
    if upload_id is None:
        upload_id = retry(lambda: api.mpu_create(key))
    elif done:
        log.info("resuming upload of %s: %d of %d parts already on the server", key, len(done),
                 len(digest.part_md5s))

    def send(idx: int) -> tuple[int, str]:
        with open(local, "rb") as f:
            f.seek(idx * digest.part_size)
            body = f.read(_part_len(digest, idx))
        etag = retry(lambda: api.mpu_upload_part(key, upload_id, idx + 1, body, md5_b64(digest.part_md5s[idx])))
        if etag.strip('"') != digest.part_md5s[idx]:
            # Content-MD5 makes the server reject corrupt bodies; this catches a file changed under us.
            raise ValueError(f"part {idx + 1} of {local} changed while uploading")
        return idx + 1, etag.strip('"')

    missing = [i for i in range(len(digest.part_md5s)) if i + 1 not in done]
    futures = [pool.submit(send, i) for i in missing]
    etags = dict(done)
    for fut in futures:
        number, etag = fut.result()
        etags[number] = etag
    retry(lambda: api.mpu_complete(key, upload_id, sorted(etags.items())))
    return MultipartResult(upload_id, len(digest.part_md5s), len(done))
