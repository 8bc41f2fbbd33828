"""One storage interface for ``file://``, ``s3://`` and ``obs://`` roots: `open_storage(uri)` and the types
its callers handle.

`base` holds the interface and the committed-tree contract, `local`, `s3` and `obs` the backends, `errors` the
typed errors and their retries, `multipart` the resumable upload the object-store backends share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tasks.storage.base import ObjectInfo, Storage, TreeUpload, dir_prefix, join_key
from tasks.storage.errors import (
    IntegrityError, NotFoundError, PermanentStorageError, StorageError, TransientStorageError,
)
from tasks.storage.local import LocalStorage

__all__ = [
    "IntegrityError", "LocalStorage", "NotFoundError", "ObjectInfo", "PermanentStorageError", "Storage",
    "StorageError", "TransientStorageError", "TreeUpload", "dir_prefix", "join_key", "open_storage",
]


def open_storage(root_uri: str, **options: Any) -> Storage:
    """The storage for ``file:///dir``, ``s3://bucket/prefix`` or ``obs://bucket/prefix``.

    ``options`` go to the backend (endpoint_url, region, credentials, max_concurrency...); anything not given
    comes from the environment (see tasks/storage/s3.py and tasks/storage/obs.py).
    """
    parsed = urlparse(root_uri)
    scheme = parsed.scheme.lower()
    if scheme == "file" or (scheme == "" and root_uri.startswith("/")):
        return LocalStorage(Path(parsed.path if scheme else root_uri), **options)
    if scheme in ("s3", "obs"):
        if not parsed.netloc or "@" in parsed.netloc:
            raise PermanentStorageError("open", f"{scheme}://…", code="InvalidURI",
                                        message="expected scheme://bucket/prefix (no credentials in URIs)")
        if scheme == "s3":
            from tasks.storage.s3 import S3Storage
            return S3Storage(parsed.netloc, parsed.path.strip("/"), **options)
        from tasks.storage.obs import ObsStorage
        return ObsStorage(parsed.netloc, parsed.path.strip("/"), **options)
    raise PermanentStorageError("open", root_uri, code="UnsupportedScheme",
                                message="supported: file://, s3://, obs://")
