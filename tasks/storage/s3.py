"""``s3://bucket/prefix`` through boto3.

Settings: explicit options win; otherwise boto3's usual sources (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, config files, instance roles,
``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``), plus
``S3_ADDRESSING_STYLE`` (``path`` / ``virtual`` / ``auto``).

Uploads: one PUT below the multipart threshold, the resumable multipart engine above it; both send
Content-MD5 (computed in the same read as the sha256), so the server rejects a corrupted body.
Downloads: one GET for small objects, boto3's TransferManager (parallel ranged GETs) for large ones.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions as bce
from boto3.s3.transfer import S3Transfer, TransferConfig
from botocore.config import Config
from s3transfer.exceptions import RetriesExceededError
from urllib3.exceptions import HTTPError as Urllib3HTTPError

from vime_engine.checkpoint.manifest import FileDigest
from tasks.storage.base import ObjectInfo, Storage, join_key
from tasks.storage.errors import (
    MISSING_BUCKET, NotFoundError, PermanentStorageError, StorageError, TransientStorageError, classify,
)
from tasks.storage.multipart import PartInfo, md5_b64, upload_resumable

_TRANSIENT_BOTO = (bce.EndpointConnectionError, bce.ConnectionClosedError, bce.ReadTimeoutError,
                   bce.ConnectTimeoutError, bce.ResponseStreamingError, bce.IncompleteReadError,
                   bce.HTTPClientError, RetriesExceededError, Urllib3HTTPError, ConnectionError, TimeoutError)

_HTTP_REASONS = {403: "Forbidden", 404: "Not Found",
                 400: "Bad Request"}


class S3Storage(Storage):
    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 region: str | None = None, addressing_style: str | None = None,
                 access_key: str | None = None, secret_key: str | None = None, session_token: str | None = None,
                 profile: str | None = None, max_concurrency: int = 10, multipart_threshold: int = 8 << 20,
                 max_attempts: int = 5, retry_base_delay: float = 0.2, connect_timeout: float = 10,
                 read_timeout: float = 60):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.root_uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.max_concurrency, self.multipart_threshold = max_concurrency, multipart_threshold
        self.max_attempts, self.retry_base_delay = max_attempts, retry_base_delay
        session = boto3.session.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                                        aws_session_token=session_token, profile_name=profile,
                                        region_name=region or os.environ.get("AWS_REGION"))
        config = Config(
            s3={"addressing_style": addressing_style or os.environ.get("S3_ADDRESSING_STYLE", "auto")},
            # botocore retries each request a little; our own loop retries whole operations on top.
            retries={"mode": "standard", "max_attempts": 3},
            max_pool_connections=2 * max_concurrency + 4,
            connect_timeout=connect_timeout, read_timeout=read_timeout,
            # We send Content-MD5 ourselves (already computed); skip the SDK's extra CRC pass.
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
        )
        self._client = session.client("s3", endpoint_url=endpoint_url, config=config)
        creds = session.get_credentials()
        frozen = creds.get_frozen_credentials() if creds else None
        self._secrets = tuple(s for s in (access_key, secret_key, session_token,
                                          *(frozen or ()),) if s)
        self._transfer = S3Transfer(self._client, TransferConfig(
            multipart_threshold=multipart_threshold, multipart_chunksize=multipart_threshold,
            max_concurrency=max_concurrency, num_download_attempts=max_attempts))
        self._parts_pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="s3-part")

    def _rebase(self, prefix: str) -> None:
        self.prefix = join_key(self.prefix, prefix)
        self.root_uri = f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def _key(self, key: str) -> str:
        return join_key(self.prefix, key)

    def _call(self, op: str, key: str, fn) -> Any:
        """Run one SDK call, translating every failure into a typed StorageError."""
        try:
            return fn()
        except StorageError:
            raise
        except bce.ClientError as exc:
            err, meta = exc.response.get("Error", {}), exc.response.get("ResponseMetadata", {})
            status = meta.get("HTTPStatusCode")
            # HEAD responses have no body: the code is just the status; say what it means.
            message = err.get("Message") or _HTTP_REASONS.get(status, "")
            raise classify(op, self.uri(key), status=status, code=err.get("Code"), message=message,
                           secrets=self._secrets) from None
        except (bce.NoCredentialsError, bce.PartialCredentialsError, bce.ParamValidationError) as exc:
            raise PermanentStorageError(op, self.uri(key), code=type(exc).__name__, message=str(exc),
                                        secrets=self._secrets) from None
        except _TRANSIENT_BOTO as exc:
            raise TransientStorageError(op, self.uri(key), code=type(exc).__name__, message=str(exc),
                                        secrets=self._secrets) from None

    # ---- primitives ---------------------------------------------------------------------------------------
    def _put_file(self, local: Path, key: str, digest: FileDigest) -> None:
        k = self._key(key)
        if digest.size < self.multipart_threshold:
            def put():
                with open(local, "rb") as f:
                    self._client.put_object(Bucket=self.bucket, Key=k, Body=f,
                                            ContentMD5=md5_b64(digest.part_md5s[0]))
            self._retry(lambda: self._call("put", key, put))
        else:
            upload_resumable(self, local, key, digest, self._parts_pool, self._retry)

    def _get_file(self, key: str, local: Path, size: int | None) -> None:
        k = self._key(key)
        if size is not None and size < self.multipart_threshold:
            def get():
                body = self._client.get_object(Bucket=self.bucket, Key=k)["Body"]
                with open(local, "wb") as f:
                    for chunk in body.iter_chunks(1 << 20):
                        f.write(chunk)
            self._retry(lambda: self._call("get", key, get))
        else:
            self._retry(lambda: self._call("get", key,
                                           lambda: self._transfer.download_file(self.bucket, k, str(local))))

    def _list(self, prefix: str) -> list[ObjectInfo]:
        full = (self.prefix + "/" if self.prefix else "") + prefix
        cut = len(self.prefix) + 1 if self.prefix else 0

        def run():
            out = []
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for o in page.get("Contents", []):
                    out.append(ObjectInfo(o["Key"][cut:], o["Size"], o.get("ETag", "").strip('"') or None))
            return out
        return self._call("list", prefix, run)

    def _head(self, key: str) -> ObjectInfo | None:
        try:
            r = self._call("head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=self._key(key)))
        except StorageError as exc:
            if exc.status == 404 and exc.code in ("404", "NoSuchKey", "NotFound"):
                return None  # a missing bucket is an error (code NoSuchBucket), a missing key is an answer
            raise
        return ObjectInfo(join_key(key), r["ContentLength"], r.get("ETag", "").strip('"') or None)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call("put", key, lambda: self._client.put_object(
            Bucket=self.bucket, Key=self._key(key), Body=data, ContentMD5=md5_b64(hashlib.md5(data).hexdigest())))

    def _create_bytes(self, key: str, data: bytes) -> bool:
        try:
            self._call("create", key, lambda: self._client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*",
                ContentMD5=md5_b64(hashlib.md5(data).hexdigest())))
        except PermanentStorageError as exc:
            if exc.status == 412:  # PreconditionFailed: the key exists
                return False
            raise
        return True

    def get_bytes(self, key: str) -> bytes:
        return self._call("get", key, lambda: self._client.get_object(Bucket=self.bucket, Key=self._key(key))
                          ["Body"].read())

    def check_root(self) -> None:
        try:
            self._retry(lambda: self._call("check", "", lambda: self._client.head_bucket(Bucket=self.bucket)))
        except NotFoundError as exc:  # a HEAD has no body: its 404 is the bucket's
            raise NotFoundError("check", self.uri(), status=exc.status, code="NoSuchBucket",
                                message=MISSING_BUCKET) from None

    def _delete_keys(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
            r = self._call("delete", keys[i], lambda: self._client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))
            if r.get("Errors"):
                e = r["Errors"][0]
                raise classify("delete", self.uri(e.get("Key", "")), status=None if e.get("Code") == "InternalError"
                               else 400, code=e.get("Code"), message=e.get("Message", ""), secrets=self._secrets)

    # ---- multipart API (tasks.storage.multipart) ----------------------------------------------------------
    def mpu_find(self, key: str) -> list[str]:
        k = self._key(key)
        r = self._call("list_uploads", key, lambda: self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=k))
        ups = [u for u in r.get("Uploads", []) if u["Key"] == k]
        return [u["UploadId"] for u in sorted(ups, key=lambda u: u["Initiated"], reverse=True)]

    def mpu_list_parts(self, key: str, upload_id: str) -> dict[int, PartInfo]:
        def run():
            pages = self._client.get_paginator("list_parts").paginate(Bucket=self.bucket, Key=self._key(key),
                                                                      UploadId=upload_id)
            return {p["PartNumber"]: PartInfo(p["Size"], p["ETag"].strip('"'))
                    for page in pages for p in page.get("Parts", [])}
        return self._call("list_parts", key, run)

    def mpu_create(self, key: str) -> str:
        return self._call("create_upload", key,
                          lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=self._key(key)))["UploadId"]

    def mpu_upload_part(self, key: str, upload_id: str, number: int, body: bytes, md5: str) -> str:
        return self._call("upload_part", key, lambda: self._client.upload_part(
            Bucket=self.bucket, Key=self._key(key), UploadId=upload_id, PartNumber=number, Body=body, ContentMD5=md5))["ETag"]

    def mpu_complete(self, key: str, upload_id: str, etags: list[tuple[int, str]]) -> None:
        parts = [{"PartNumber": n, "ETag": f'"{e}"'} for n, e in etags]
        self._call("complete_upload", key, lambda: self._client.complete_multipart_upload(
            Bucket=self.bucket, Key=self._key(key), UploadId=upload_id, MultipartUpload={"Parts": parts}))

    def mpu_abort(self, key: str, upload_id: str) -> None:
        self._call("abort_upload", key, lambda: self._client.abort_multipart_upload(
            Bucket=self.bucket, Key=self._key(key), UploadId=upload_id))
