"""Typed storage errors, their classification, retry with backoff, and credential redaction.

Every backend turns its library's failure shape (a boto exception, an OBS response with a status, an
OSError) into one of these, so callers retry on ``TransientStorageError`` and fail fast on the rest.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

log = logging.getLogger("vimeflow.storage")
T = TypeVar("T")

# Codes S3 and OBS use for conditions that go away by themselves.
_TRANSIENT_CODES = {
    "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling", "ThrottlingException",
    "RequestTimeTooSkewed", "OperationAborted",
    "ConditionalRequestConflict",  # S3: a conditional write raced another to the same key; ask again
}
_NOT_FOUND_CODES = {"NoSuchKey", "NoSuchBucket", "NoSuchUpload", "NotFound", "404"}
_REFUSED_HINT = "check the access key, its secret and the bucket policy"
MISSING_BUCKET = "the bucket does not exist: create it or fix the storage root"


class StorageError(Exception):
    """A failed storage operation: which operation, on which URI, with the service's status and code."""

    def __init__(self, op: str, uri: str, *, status: int | None = None, code: str | None = None,
                 message: str = "", secrets: Iterable[str | None] = ()):
        self.op = op
        self.uri = redact(uri, secrets)
        self.status = status
        self.code = code
        self.message = redact(message, secrets)
        bits = [f"status={status}" if status is not None else "", f"code={code}" if code else ""]
        detail = " ".join(b for b in bits if b)
        super().__init__(f"{op} {self.uri} failed" + (f" ({detail})" if detail else "")
                         + (f": {self.message}" if self.message else ""))


class TransientStorageError(StorageError):
    """Timeouts, 5xx, throttling, dropped connections: worth retrying."""


class PermanentStorageError(StorageError):
    """403, bad bucket names, bad requests, missing credentials: retrying will not help."""


class NotFoundError(PermanentStorageError):
    """The bucket, object or committed tree (manifest) does not exist."""


class IntegrityError(StorageError):
    """Data arrived but its size or sha256 does not match what the manifest promises."""


def classify(op: str, uri: str, *, status: int | None, code: str | None, message: str = "",
             secrets: Iterable[str | None] = ()) -> StorageError:
    """Map an HTTP status and service error code to the error type that decides retry behaviour."""
    secrets = tuple(secrets)
    if status in (401, 403):
        message = f"{message} ({_REFUSED_HINT})" if message else _REFUSED_HINT
    kw = dict(status=status, code=code, message=message, secrets=secrets)
    if code in _NOT_FOUND_CODES or status == 404:
        return NotFoundError(op, uri, **kw)
    if code in _TRANSIENT_CODES or status is None or status >= 500 or status in (408, 429):
        return TransientStorageError(op, uri, **kw)
    return PermanentStorageError(op, uri, **kw)


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """Replace every known credential value (longer than 3 chars, to avoid mangling) with ***."""
    for s in secrets:
        if s and len(s) > 3:
            text = text.replace(s, "***")
    return text


def with_retries(fn: Callable[[], T], *, attempts: int = 5, base_delay: float = 0.2, max_delay: float = 5.0,
                 sleep: Callable[[float], None] = time.sleep) -> T:
    """Call ``fn``; on TransientStorageError retry with full-jitter exponential backoff.

    Invariant: at most ``attempts`` calls; permanent errors propagate from the first call.
    """
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except TransientStorageError as exc:
            if attempt == attempts:
                raise
            delay = random.uniform(0, min(max_delay, base_delay * 2 ** (attempt - 1)))
            log.warning("retrying after transient error (attempt %d/%d, %.2fs): %s", attempt, attempts, delay, exc)
            sleep(delay)
    raise AssertionError("unreachable")
