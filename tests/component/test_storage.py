"""Storage against real clients on real HTTP: file://, s3:// (boto3) and obs:// (esdk-obs-python), both on
a moto server, through a fault-injecting proxy where the test needs faults."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import boto3
import pytest

from vime_engine.checkpoint.manifest import MANIFEST_NAME, Manifest
from tasks.storage import (
    IntegrityError, NotFoundError, PermanentStorageError, Storage, TransientStorageError, open_storage,
)
from tests.support.fault_proxy import is_upload_part
from tests.support.s3_fixtures import TEST_ACCESS_KEY, TEST_SECRET_KEY

MiB = 1 << 20
FAST = dict(multipart_threshold=5 * MiB, retry_base_delay=0.01, max_concurrency=4)


def make_tree(root: Path, big_mib: int = 12) -> Path:
    """A checkpoint-like tree: small files in nested folders, an empty file, one multipart-size file."""
    rng = __import__("random").Random(7)
    (root / "model").mkdir(parents=True)
    (root / "rng").mkdir()
    (root / "config.json").write_text('{"hidden": 128}')
    (root / "rng" / "empty.bin").write_bytes(b"")
    for i in range(5):
        (root / "rng" / f"state_{i}.pt").write_bytes(rng.randbytes(1000 + i))
    (root / "model" / "weights.safetensors").write_bytes(rng.randbytes(big_mib * MiB + 123))
    return root


def open_root(kind: str, endpoint: str, bucket: str, tmp_path: Path, prefix: str = "runs/r1", **kw) -> Storage:
    options = {**FAST, **kw}
    if kind == "file":
        return open_storage((tmp_path / "store").as_uri() + "/" + prefix)
    if kind == "s3":
        return open_storage(f"s3://{bucket}/{prefix}", endpoint_url=endpoint, addressing_style="path", **options)
    return open_storage(f"obs://{bucket}/{prefix}", server=endpoint, **options)


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(params=["file", "s3", "obs"])
def backend(request, fault_proxy, make_bucket, tmp_path):
    return open_root(request.param, fault_proxy.url, make_bucket(), tmp_path)


def test_commit_fetch_roundtrip_and_object_ops(backend, tmp_path):
    src = make_tree(tmp_path / "src")
    manifest = backend.commit_tree(src, "ckpt/rollout_0000001", meta={"step": 1})

    raw = backend.get_bytes("ckpt/rollout_0000001/manifest.json")
    assert manifest.hash == hashlib.sha256(raw).hexdigest()
    assert Manifest.from_bytes(raw).files == manifest.files
    assert set(manifest.files) == set(tree_bytes(src))
    assert manifest.files["model/weights.safetensors"].size == 12 * MiB + 123

    got = backend.fetch_tree("ckpt/rollout_0000001", tmp_path / "dst")
    assert got.files == manifest.files
    dst = tree_bytes(tmp_path / "dst")
    assert dst.pop(MANIFEST_NAME) == raw
    assert dst == tree_bytes(src)

    assert backend.exists("ckpt/rollout_0000001/config.json")
    assert not backend.exists("ckpt/rollout_0000001/nope.json")
    backend.write_json("ckpt/LATEST.json", {"rollout_id": 1})
    assert backend.child("ckpt").read_json("LATEST.json") == {"rollout_id": 1}
    keys = {o.key for o in backend.list("ckpt/")}
    assert "ckpt/rollout_0000001/rng/empty.bin" in keys and "ckpt/LATEST.json" in keys
    assert backend.delete_prefix("ckpt/rollout_0000001") == len(manifest.files) + 1
    assert {o.key for o in backend.list("ckpt/")} == {"ckpt/LATEST.json"}
    with pytest.raises(NotFoundError, match="not committed"):
        backend.fetch_tree("ckpt/rollout_0000001", tmp_path / "dst2")


def test_uncommitted_prefix_is_not_a_tree(backend, tmp_path):
    src = make_tree(tmp_path / "src", big_mib=0)
    backend.put_tree(src, "half")
    with pytest.raises(NotFoundError) as err:
        backend.fetch_tree("half", tmp_path / "dst")
    assert err.value.op == "read_manifest" and "half" in err.value.uri
    assert not (tmp_path / "dst" / MANIFEST_NAME).exists()


def test_fetch_detects_a_corrupted_object(backend, tmp_path):
    src = make_tree(tmp_path / "src", big_mib=0)
    backend.commit_tree(src, "t")
    original = backend.get_bytes("t/rng/state_1.pt")
    backend.put_bytes("t/rng/state_1.pt", bytes(b ^ 0xFF for b in original))  # same size, other bytes
    with pytest.raises(IntegrityError, match="state_1.pt"):
        backend.fetch_tree("t", tmp_path / "dst")
    assert not (tmp_path / "dst" / MANIFEST_NAME).exists()


@pytest.mark.parametrize("kind", ["s3", "obs"])
def test_recommit_of_an_unchanged_tree_sends_only_the_manifest(kind, fault_proxy, make_bucket, tmp_path):
    store = open_root(kind, fault_proxy.url, make_bucket(), tmp_path)
    src = make_tree(tmp_path / "src")
    first = store.commit_tree(src, "t")
    fault_proxy.reset()
    second = store.commit_tree(src, "t")
    puts = [e.path for e in fault_proxy.log if e.method in ("PUT", "POST") and "delete" not in e.query]
    assert puts == [f"/{store.bucket}/runs/r1/t/manifest.json"]
    assert second.files == first.files


@pytest.mark.parametrize("kind", ["s3", "obs"])
def test_transient_errors_and_dropped_connections_are_retried(kind, fault_proxy, make_bucket, tmp_path):
    store = open_root(kind, fault_proxy.url, make_bucket(), tmp_path)
    src = make_tree(tmp_path / "src")
    fault_proxy.fail(2, status=503, code="ServiceUnavailable", match=lambda m, p, q: m == "PUT")
    fault_proxy.fail(2, status=500, code="InternalError", match=is_upload_part)
    manifest = store.commit_tree(src, "t")
    assert fault_proxy.count(lambda e: e.status in (500, 503)) == 4

    fault_proxy.reset()
    fault_proxy.drop(2, match=lambda m, p, q: m == "GET" and p.endswith("weights.safetensors"))
    fault_proxy.drop(1, match=lambda m, p, q: m == "GET" and p.endswith("state_3.pt"))
    fault_proxy.fail(1, status=503, match=lambda m, p, q: m == "GET" and p.endswith("config.json"))
    got = store.fetch_tree("t", tmp_path / "dst")
    assert got.files == manifest.files
    assert fault_proxy.count(lambda e: e.status == -1) == 3  # the dropped exchanges happened
    dst = tree_bytes(tmp_path / "dst")
    dst.pop(MANIFEST_NAME)
    assert dst == tree_bytes(src)


@pytest.mark.parametrize("kind", ["s3", "obs"])
def test_wrong_credentials_fail_fast_with_a_clear_error_and_no_manifest(kind, fault_proxy, make_bucket,
                                                                        tmp_path, caplog, monkeypatch):
    bucket = make_bucket()
    fault_proxy.allowed_keys = {TEST_ACCESS_KEY}
    bad_ak, bad_sk = "AKIAWRONGKEY99999999", "wrong-secret-value-123456"
    for name in ("AWS_ACCESS_KEY_ID", "OBS_ACCESS_KEY_ID"):
        monkeypatch.setenv(name, bad_ak)
    for name in ("AWS_SECRET_ACCESS_KEY", "OBS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, bad_sk)
    caplog.set_level("DEBUG")
    store = open_root(kind, fault_proxy.url, bucket, tmp_path)
    with pytest.raises(PermanentStorageError) as err:
        store.commit_tree(make_tree(tmp_path / "src", big_mib=0), "t")
    e = err.value
    assert (e.status, e.code) == (403, "InvalidAccessKeyId")
    assert f"{kind}://{bucket}/runs/r1/t" in str(e) and "does not exist in our records" in str(e)
    for secret in (bad_ak, bad_sk):
        assert secret not in str(e) and secret not in repr(e.args)
    assert bad_sk not in caplog.text
    assert all(bad_ak not in r.getMessage() for r in caplog.records if r.name.startswith("vimeflow"))
    assert fault_proxy.count(lambda x: x.status == 403) <= 3  # no retry storm on a permanent error
    direct = boto3.client("s3", endpoint_url=fault_proxy.url)
    fault_proxy.allowed_keys = None
    assert direct.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0  # nothing, manifest least of all
    fault_proxy.allowed_keys = {TEST_ACCESS_KEY}
    with pytest.raises(PermanentStorageError, match=f"check {kind}://{bucket}/runs/r1 failed \\(status=403.*check "
                                                    "the access key, its secret and the bucket policy"):
        store.check_root()  # what `vimeflow run` asks before Prefect starts


@pytest.mark.parametrize("kind", ["s3", "obs"])
def test_missing_bucket_is_a_permanent_not_found(kind, fault_proxy, storage_env, tmp_path):
    store = open_root(kind, fault_proxy.url, "vf-no-such-bucket", tmp_path)
    with pytest.raises(NotFoundError) as err:
        store.commit_tree(make_tree(tmp_path / "src", big_mib=0), "t")
    assert err.value.code == "NoSuchBucket" and "vf-no-such-bucket" in str(err.value)
    assert len(fault_proxy.log) <= 8  # failed at once, not after a retry loop per file
    assert TEST_SECRET_KEY not in str(err.value) and TEST_ACCESS_KEY not in str(err.value)
    with pytest.raises(NotFoundError, match=f"check {kind}://vf-no-such-bucket/runs/r1 failed \\(status=404 "
                                            "code=NoSuchBucket\\): the bucket does not exist"):
        store.check_root()


@pytest.mark.parametrize("kind", ["s3", "obs"])
def test_interrupted_upload_resumes_without_resending_finished_parts(kind, fault_proxy, make_bucket, tmp_path):
    store = open_root(kind, fault_proxy.url, make_bucket(), tmp_path, max_concurrency=1)
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(4 * 5 * MiB + 77))  # 5 parts of 5 MiB (last one short)
    # Credentials revoked mid-upload (e.g. an STS token expiring): after 2 parts every part is refused.
    fault_proxy.fail(100, status=403, code="AccessDenied", skip=2, match=is_upload_part)
    with pytest.raises(PermanentStorageError) as err:
        store.commit_tree(src, "t")
    assert err.value.status == 403
    first = {e.part_number for e in fault_proxy.log if is_upload_part(e.method, e.path, e.query) and e.status == 200}
    upload_ids = {e.query["uploadId"][0] for e in fault_proxy.log if e.part_number}
    assert first == {1, 2} and not store.exists("t/manifest.json")

    fault_proxy.reset()
    store.commit_tree(src, "t")
    second = [e for e in fault_proxy.log if is_upload_part(e.method, e.path, e.query)]
    # Parts 1-2 are never sent again; 3-5 each land once (a part retried after a timeout may be sent twice).
    assert {e.part_number for e in second} == {3, 4, 5}
    assert sorted(e.part_number for e in second if e.status == 200) == [3, 4, 5]
    assert {e.query["uploadId"][0] for e in second} == upload_ids  # the same upload, resumed
    store.fetch_tree("t", tmp_path / "dst")
    assert (tmp_path / "dst" / "big.bin").read_bytes() == (src / "big.bin").read_bytes()


def test_transient_error_carries_operation_uri_status_and_code(fault_proxy, make_bucket, tmp_path):
    store = open_root("s3", fault_proxy.url, make_bucket(), tmp_path, max_attempts=2)
    fault_proxy.fail(100, status=503, code="SlowDown", match=lambda m, p, q: m == "GET")
    with pytest.raises(TransientStorageError) as err:
        store.read_json("state.json")
    assert (err.value.op, err.value.status, err.value.code) == ("get", 503, "SlowDown")
    assert err.value.uri.endswith("/runs/r1/state.json")


def test_unsupported_and_credential_bearing_uris_are_refused():
    with pytest.raises(PermanentStorageError, match="supported"):
        open_storage("gs://bucket/x")
    with pytest.raises(PermanentStorageError) as err:
        open_storage("s3://AKIAXX:supersecret@bucket/x")
    assert "supersecret" not in str(err.value)


def test_the_test_s3_endpoint_serves_an_obs_signature_that_holds_four_slashes(moto_endpoint, make_bucket):
    """moto reads the service from a SigV4 credential scope, 'a/b/region/service/c'; an OBS signature with four
    '/' in its base64 looked like one and was answered 500 (a CI run failed on it). The fixture serves S3 only."""
    import httpx

    bucket = make_bucket()
    r = httpx.get(f"{moto_endpoint}/{bucket}/missing.json", headers={"Authorization": "OBS AK:ab/cd/ef/gh/ij="})
    assert r.status_code == 404, r.text
    assert "NoSuchKey" in r.text


def test_a_file_root_that_cannot_be_made_is_refused_by_its_check(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(PermanentStorageError, match="a-file is a file, so no directory can be made under it"):
        open_storage((tmp_path / "a-file" / "runs").as_uri()).check_root()
    open_storage((tmp_path / "new" / "runs").as_uri()).check_root()  # made when first written
