"""The pure parts of storage: manifest format, digests and ETags, path safety, retry policy, redaction."""

from __future__ import annotations

import hashlib
import json

import pytest

from vime_engine.checkpoint.manifest import FileEntry, Manifest, check_relpath, digest_file, part_size_for
from tasks.storage.errors import (
    NotFoundError, PermanentStorageError, StorageError, TransientStorageError, classify, with_retries,
)


def test_digest_cuts_parts_and_predicts_s3_etags(tmp_path):
    data = bytes(range(256)) * 100  # 25600 bytes
    p = tmp_path / "f"
    p.write_bytes(data)
    d = digest_file(p, part_size=10000)
    assert (d.size, d.sha256) == (25600, hashlib.sha256(data).hexdigest())
    assert d.part_md5s == tuple(hashlib.md5(data[i:i + 10000]).hexdigest() for i in (0, 10000, 20000))
    joined = b"".join(hashlib.md5(data[i:i + 10000]).digest() for i in (0, 10000, 20000))
    assert d.expected_etag(multipart=True) == hashlib.md5(joined).hexdigest() + "-3"
    exact = digest_file(p, part_size=12800)
    assert len(exact.part_md5s) == 2  # no empty trailing part when the size divides evenly
    (tmp_path / "empty").write_bytes(b"")
    assert digest_file(tmp_path / "empty", 10).expected_etag(False) == hashlib.md5(b"").hexdigest()


def test_part_size_is_deterministic_and_respects_the_part_limit():
    assert part_size_for(1) == part_size_for(78 << 30) == 8 << 20  # 78 GiB still fits 10,000 parts of 8 MiB
    assert part_size_for(79 << 30) == 9 << 20
    big = 200 << 30
    size = part_size_for(big)
    assert size % (1 << 20) == 0 and -(-big // size) <= 10_000 and size == part_size_for(big)


def test_manifest_bytes_are_canonical_and_hash_is_their_sha256():
    m = Manifest(files={"b/x.bin": FileEntry(3, "a" * 64)},
                 created="2026-01-01T00:00:00+00:00", meta={"step": 7})
    raw = m.to_bytes()
    doc = json.loads(raw)
    assert doc == {"version": 1, "files": {"b/x.bin": {"size": 3, "sha256": "a" * 64}},
                   "created": "2026-01-01T00:00:00+00:00", "meta": {"step": 7}}
    assert m.hash == hashlib.sha256(raw).hexdigest()
    assert Manifest.from_bytes(raw) == m
    with pytest.raises(ValueError, match="version"):
        Manifest.from_bytes(json.dumps({**doc, "version": 2}).encode())
    with pytest.raises(ValueError, match="unsafe"):
        Manifest.from_bytes(json.dumps({**doc, "files": {"../etc/passwd": {"size": 1, "sha256": "a" * 64}}}).encode())


@pytest.mark.parametrize("bad", ["", "/abs", "a/../b", "a//b", "./a", "a\\b"])
def test_relpaths_that_could_escape_are_rejected(bad):
    with pytest.raises(ValueError):
        check_relpath(bad)


def test_classification_by_status_and_code():
    assert isinstance(classify("get", "s3://b/k", status=503, code="SlowDown"), TransientStorageError)
    assert isinstance(classify("get", "s3://b/k", status=None, code="ConnectionClosed"), TransientStorageError)
    assert isinstance(classify("get", "s3://b/k", status=404, code="NoSuchBucket"), NotFoundError)
    e = classify("put", "obs://b/k", status=403, code="AccessDenied", message="key AK123456 refused",
                 secrets=["AK123456"])
    assert type(e) is PermanentStorageError and "AK123456" not in str(e)
    assert str(e) == ("put obs://b/k failed (status=403 code=AccessDenied): key *** refused "
                      "(check the access key, its secret and the bucket policy)")


def test_retries_only_transient_errors_with_bounded_attempts():
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise TransientStorageError("get", "s3://b/k", status=503)
        return "ok"

    assert with_retries(flaky, attempts=5, sleep=sleeps.append) == "ok" and len(calls) == 3 and len(sleeps) == 2

    def always(exc: StorageError):
        def fn():
            calls.append(1)
            raise exc
        return fn

    calls.clear()
    with pytest.raises(PermanentStorageError):
        with_retries(always(PermanentStorageError("put", "s3://b/k", status=403)), sleep=sleeps.append)
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(TransientStorageError):
        with_retries(always(TransientStorageError("put", "s3://b/k", status=500)), attempts=4, sleep=lambda s: None)
    assert len(calls) == 4
