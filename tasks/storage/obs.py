"""``obs://bucket/prefix`` through Huawei Cloud's esdk-obs-python (``ObsClient``).

Settings: explicit options win, then the environment:

- server: ``OBS_ENDPOINT`` or ``OBS_SERVER`` (e.g. ``https://obs.cn-north-4.myhuaweicloud.com``);
- credentials: ``OBS_ACCESS_KEY_ID`` / ``OBS_SECRET_ACCESS_KEY`` / ``OBS_SECURITY_TOKEN`` (the names the
  SDK's own ENV provider reads), else ``HUAWEICLOUD_SDK_AK`` / ``HUAWEICLOUD_SDK_SK`` /
  ``HUAWEICLOUD_SDK_SECURITY_TOKEN`` (Huawei Cloud SDK and ModelArts convention), else ``AccessKeyID`` /
  ``SecretAccessKey`` (the OBS SDK samples);
- ``OBS_REGION``, ``OBS_SIGNATURE`` (obs / v2 / v4), ``OBS_PATH_STYLE`` (1 for path-style addressing).

The SDK returns failures as a response with ``status`` / ``errorCode`` / ``errorMessage``, and raises only
when the connection itself fails after its own retries; ``_call`` turns both into typed StorageErrors.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from obs import (
    CompleteMultipartUploadRequest, CompletePart, DeleteObjectsRequest, ListMultipartUploadsRequest, Object,
    ObsClient, PutObjectHeader,
)

from vime_engine.checkpoint.manifest import FileDigest
from tasks.storage.base import ObjectInfo, Storage, join_key
from tasks.storage.errors import (
    MISSING_BUCKET, NotFoundError, PermanentStorageError, StorageError, TransientStorageError, classify,
)
from tasks.storage.multipart import PartInfo, md5_b64, upload_resumable

_ENV_AK = ("OBS_ACCESS_KEY_ID", "HUAWEICLOUD_SDK_AK", "AccessKeyID")
_ENV_SK = ("OBS_SECRET_ACCESS_KEY", "HUAWEICLOUD_SDK_SK", "SecretAccessKey")
_ENV_TOKEN = ("OBS_SECURITY_TOKEN", "HUAWEICLOUD_SDK_SECURITY_TOKEN")
# OBS's create-only PUT: an object the key already names is kept and the request answered 409 ObjectAlreadyExists
# (OBS does not take S3's If-None-Match).
FORBID_OVERWRITE = "x-obs-forbid-overwrite"


def _first_env(names: tuple[str, ...]) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


class ObsStorage(Storage):
    def __init__(self, bucket: str, prefix: str = "", *, server: str | None = None, region: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None, security_token: str | None = None,
                 signature: str | None = None, path_style: bool | None = None, max_concurrency: int = 10,
                 multipart_threshold: int = 8 << 20, max_attempts: int = 5, retry_base_delay: float = 0.2,
                 timeout: int = 60):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.root_uri = f"obs://{bucket}/{self.prefix}".rstrip("/")
        self.max_concurrency, self.multipart_threshold = max_concurrency, multipart_threshold
        self.max_attempts, self.retry_base_delay = max_attempts, retry_base_delay
        server = server or os.environ.get("OBS_ENDPOINT") or os.environ.get("OBS_SERVER")
        if not server:
            raise PermanentStorageError("open", self.root_uri, code="NoEndpoint",
                                        message="set OBS_ENDPOINT (or OBS_SERVER) or pass server=")
        ak, sk = access_key or _first_env(_ENV_AK), secret_key or _first_env(_ENV_SK)
        token = security_token or _first_env(_ENV_TOKEN)
        if not ak or not sk:
            raise PermanentStorageError("open", self.root_uri, code="NoCredentials",
                                        message=f"set {_ENV_AK[0]} and {_ENV_SK[0]} (or {_ENV_AK[1]}/{_ENV_SK[1]})")
        self._secrets = tuple(s for s in (ak, sk, token) if s)
        if path_style is None:
            path_style = os.environ.get("OBS_PATH_STYLE", "").lower() in ("1", "true", "yes")
        self._client = ObsClient(
            access_key_id=ak, secret_access_key=sk, security_token=token, server=server,
            region=region or os.environ.get("OBS_REGION", "region"),
            signature=signature or os.environ.get("OBS_SIGNATURE", "obs"), path_style=path_style,
            # Negotiation probes the bucket's signature type with an extra request; we know ours.
            is_signature_negotiation=False, timeout=timeout, max_retry_count=2,
            pool_size=2 * max_concurrency + 4)
        self._parts_pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="obs-part")

    def _rebase(self, prefix: str) -> None:
        self.prefix = join_key(self.prefix, prefix)
        self.root_uri = f"obs://{self.bucket}/{self.prefix}".rstrip("/")

    def _key(self, key: str) -> str:
        return join_key(self.prefix, key)

    def _call(self, op: str, key: str, fn) -> Any:
        """Run one SDK call; a non-2xx response or a raised connection error becomes a typed StorageError."""
        try:
            resp = fn()
        except StorageError:
            raise
        except (OSError, ConnectionError, TimeoutError) as exc:
            raise TransientStorageError(op, self.uri(key), code=type(exc).__name__, message=str(exc),
                                        secrets=self._secrets) from None
        except Exception as exc:  # the SDK raises bare Exception for dropped/odd HTTP exchanges
            if type(exc).__module__.startswith(("http", "urllib3", "ssl", "socket")) or "connect" in str(exc).lower():
                raise TransientStorageError(op, self.uri(key), code=type(exc).__name__, message=str(exc),
                                            secrets=self._secrets) from None
            raise PermanentStorageError(op, self.uri(key), code=type(exc).__name__, message=str(exc),
                                        secrets=self._secrets) from None
        if resp.status >= 300:
            raise classify(op, self.uri(key), status=resp.status, code=resp.errorCode,
                           message=resp.errorMessage or resp.reason or "", secrets=self._secrets)
        return resp

    # ---- primitives ---------------------------------------------------------------------------------------
    def _put_file(self, local: Path, key: str, digest: FileDigest) -> None:
        if digest.size < self.multipart_threshold:
            headers = PutObjectHeader(md5=md5_b64(digest.part_md5s[0]))
            self._retry(lambda: self._call("put", key, lambda: self._client.putFile(
                self.bucket, self._key(key), str(local), headers=headers)))
        else:
            upload_resumable(self, local, key, digest, self._parts_pool, self._retry)

    def _get_file(self, key: str, local: Path, size: int | None) -> None:
        def get():
            self._call("get", key, lambda: self._client.getObject(self.bucket, self._key(key),
                                                                 downloadPath=str(Path(local).resolve())))
            if size is not None and local.stat().st_size != size:  # a connection dropped mid-body
                raise TransientStorageError("get", self.uri(key), code="IncompleteBody",
                                            message=f"got {local.stat().st_size} of {size} bytes")
        self._retry(get)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        full = (self.prefix + "/" if self.prefix else "") + prefix
        cut = len(self.prefix) + 1 if self.prefix else 0
        out, marker = [], None
        while True:
            body = self._call("list", prefix, lambda: self._client.listObjects(
                self.bucket, prefix=full, marker=marker, max_keys=1000)).body
            for c in body.contents or []:
                out.append(ObjectInfo(c.key[cut:], int(c.size), (c.etag or "").strip('"') or None))
            if not body.is_truncated or not body.contents:
                return out
            marker = body.next_marker or body.contents[-1].key

    def _head(self, key: str) -> ObjectInfo | None:
        try:
            body = self._call("head", key, lambda: self._client.getObjectMetadata(self.bucket, self._key(key))).body
        except StorageError as exc:
            if exc.status == 404 and exc.code != "NoSuchBucket":
                return None
            raise
        return ObjectInfo(join_key(key), int(body.contentLength), (body.etag or "").strip('"') or None)

    def put_bytes(self, key: str, data: bytes) -> None:
        headers = PutObjectHeader(md5=md5_b64(hashlib.md5(data).hexdigest()))
        self._call("put", key, lambda: self._client.putContent(self.bucket, self._key(key), content=data,
                                                               headers=headers))

    def _create_bytes(self, key: str, data: bytes) -> bool:
        headers = PutObjectHeader(md5=md5_b64(hashlib.md5(data).hexdigest()))
        try:
            self._call("create", key, lambda: self._client.putContent(
                self.bucket, self._key(key), content=data, headers=headers,
                extensionHeaders={FORBID_OVERWRITE: "true"}))
        except PermanentStorageError as exc:
            if exc.status == 409 and exc.code == "ObjectAlreadyExists":
                return False
            raise
        return True

    def get_bytes(self, key: str) -> bytes:
        resp = self._call("get", key, lambda: self._client.getObject(self.bucket, self._key(key),
                                                                     loadStreamInMemory=True))
        return bytes(resp.body.buffer)

    def check_root(self) -> None:
        try:
            self._retry(lambda: self._call("check", "", lambda: self._client.headBucket(self.bucket)))
        except NotFoundError as exc:  # a HEAD has no body: its 404 is the bucket's
            raise NotFoundError("check", self.uri(), status=exc.status, code="NoSuchBucket",
                                message=MISSING_BUCKET) from None

    def _delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            req = DeleteObjectsRequest(quiet=True, objects=[Object(key=self._key(k)) for k in keys[i:i + 1000]])
            body = self._call("delete", keys[i], lambda: self._client.deleteObjects(self.bucket, req)).body
            errors = getattr(body, "error", None) or []
            if errors:
                e = errors[0]
                raise classify("delete", self.uri(str(getattr(e, "key", ""))), status=400,
                               code=getattr(e, "code", None), message=str(getattr(e, "message", "")),
                               secrets=self._secrets)

    # ---- multipart API (tasks.storage.multipart) ----------------------------------------------------------
    def mpu_find(self, key: str) -> list[str]:
        k = self._key(key)
        body = self._call("list_uploads", key, lambda: self._client.listMultipartUploads(
            self.bucket, ListMultipartUploadsRequest(prefix=k))).body
        ups = [u for u in body.upload or [] if u.key == k]
        return [u.uploadId for u in sorted(ups, key=lambda u: u.initiated or "", reverse=True)]

    def mpu_list_parts(self, key: str, upload_id: str) -> dict[int, PartInfo]:
        out, marker = {}, None
        while True:
            body = self._call("list_parts", key, lambda: self._client.listParts(
                self.bucket, self._key(key), upload_id, maxParts=1000, partNumberMarker=marker)).body
            for p in body.parts or []:
                out[int(p.partNumber)] = PartInfo(int(p.size), (p.etag or "").strip('"'))
            if not body.isTruncated:
                return out
            marker = body.nextPartNumberMarker

    def mpu_create(self, key: str) -> str:
        return self._call("create_upload", key,
                          lambda: self._client.initiateMultipartUpload(self.bucket, self._key(key))).body.uploadId

    def mpu_upload_part(self, key: str, upload_id: str, number: int, body: bytes, md5: str) -> str:
        return self._call("upload_part", key, lambda: self._client.uploadPart(
            self.bucket, self._key(key), number, upload_id, content=body, md5=md5)).body.etag

    def mpu_complete(self, key: str, upload_id: str, etags: list[tuple[int, str]]) -> None:
        req = CompleteMultipartUploadRequest(parts=[CompletePart(partNum=n, etag=f'"{e}"') for n, e in etags])
        self._call("complete_upload", key, lambda: self._client.completeMultipartUpload(
            self.bucket, self._key(key), upload_id, req))

    def mpu_abort(self, key: str, upload_id: str) -> None:
        self._call("abort_upload", key, lambda: self._client.abortMultipartUpload(self.bucket, self._key(key),
                                                                                  upload_id))
