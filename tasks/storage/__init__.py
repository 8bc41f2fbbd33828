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
    "SUPPORTED_ROOTS", "IntegrityError", "LocalStorage", "NotFoundError", "ObjectInfo", "PermanentStorageError",
    "Storage", "StorageError", "TransientStorageError", "TreeUpload", "dir_prefix", "join_key", "open_storage",
    "root_problem",
]


SUPPORTED_ROOTS = "file:///DIR, s3://BUCKET[/PREFIX] or obs://BUCKET[/PREFIX]"


def root_problem(root_uri: str) -> str | None:
    """Why `root_uri` is not a storage root, ending with the supported forms (None: it is one). The pipeline's
    parameters and `open_storage` refuse the same URIs with the same words."""
    parsed = urlparse(root_uri)
    scheme = parsed.scheme.lower()
    if scheme == "file" or (scheme == "" and root_uri.startswith("/")):
        problem = None if (parsed.path if scheme else root_uri).startswith("/") else "not an absolute directory"
    elif scheme in ("s3", "obs"):
        problem = ("no bucket" if not parsed.netloc else
                   "credentials in the URI (give them in the environment)" if "@" in parsed.netloc else None)
    else:
        problem = f"unsupported scheme {scheme}://" if scheme else "no scheme"
    return None if problem is None else f"{problem}; supported: {SUPPORTED_ROOTS}"


def open_storage(root_uri: str, **options: Any) -> Storage:
    """The storage for ``file:///dir``, ``s3://bucket/prefix`` or ``obs://bucket/prefix``.

    ``options`` go to the backend (endpoint_url, region, credentials, max_concurrency...); anything not given
    comes from the environment (see tasks/storage/s3.py and tasks/storage/obs.py).
    """
    parsed = urlparse(root_uri)
    scheme = parsed.scheme.lower()
    if problem := root_problem(root_uri):
        where = f"{scheme}://…" if scheme in ("s3", "obs") else root_uri  # an s3 URI may hold credentials
        code = "InvalidURI" if scheme in ("s3", "obs", "file", "") else "UnsupportedScheme"
        raise PermanentStorageError("open", where, code=code, message=problem)
    if scheme in ("file", ""):
        return LocalStorage(Path(parsed.path if scheme else root_uri), **options)
    if scheme == "s3":
        from tasks.storage.s3 import S3Storage
        return S3Storage(parsed.netloc, parsed.path.strip("/"), **options)
    from tasks.storage.obs import ObsStorage
    return ObsStorage(parsed.netloc, parsed.path.strip("/"), **options)
