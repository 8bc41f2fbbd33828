"""One writer under a storage prefix at a time: a lease with its holder's name, renewed while the holder works and
taken over by a successor only once it has expired (a holder that was preempted or killed renews no more).

Object stores have no lock and no compare-and-swap common to S3 and OBS; both have a create-only PUT (S3's
If-None-Match: *, OBS's forbid-overwrite; `Storage.create_bytes`). The lease is built on that alone, in
generations under `prefix`:

- `holder-GGGGGGGG.json`: created once, create-only, by the contender that takes generation G: its token, who it
  is (run, host, pid) and its first lease end. Of two contenders for G the service lets one create it.
- `lease-GGGGGGGG.json`: the lease end of generation G, rewritten by G's holder every `renew_every` seconds (and
  marked released at the end). Only G's holder writes it, so a plain PUT is safe.

The highest generation is the lease. A contender reads it: none, released, or past its lease end by more than
`grace` (which covers clocks that disagree) and it creates G+1; otherwise it waits, and is refused, naming the
holder, as soon as it sees the holder renew (proof that it lives), or when the lease outlasts one lease period of
waiting. A holder checks at every renewal that no higher generation exists, and counts its lease lost once its
own lease end passed without a renewal: it must stop writing before a successor may start (`ensure_held` before
each write). Generations below the new one are deleted by its holder.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from tasks.storage.base import Storage, dir_prefix, join_key
from tasks.storage.errors import NotFoundError, StorageError

log = logging.getLogger("vimeflow.storage")

LEASE_SECONDS = 120.0  # a renewal that fails for this long (storage retries and timeouts included) loses the lease
RENEW_EVERY = LEASE_SECONDS / 4
CLOCK_GRACE = 15.0  # how far the clocks of two hosts may disagree
POLL_SECONDS = 2.0  # a waiting contender reads the lease this often (a few small requests each time)


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: what it is doing, where it runs."""

    run: str  # e.g. "flow run 'calm-otter' (3f2a…), train_chunk from rollout 4"
    host: str
    pid: int


@dataclass(frozen=True)
class LeaseState:
    """A generation as its two objects tell it."""

    generation: int
    token: str
    holder: Holder
    lease_end: float  # seconds since the epoch, on the holder's clock
    released: bool

    def describe(self) -> str:
        until = datetime.fromtimestamp(self.lease_end, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        return (f"{self.holder.run}, on host {self.holder.host}, pid {self.holder.pid}, lease "
                f"{'released' if self.released else 'until ' + until}")


class LeaseHeld(RuntimeError):
    """Another live holder has the lease: retrying cannot help until it ends."""


class LeaseLost(LeaseHeld):
    """This holder's lease expired or was taken over: it must write nothing more."""


def _key(kind: str, generation: int) -> str:
    return f"{kind}-{generation:08d}.json"


def _generation(key: str, kinds: tuple[str, ...] = ("holder",)) -> int | None:
    """The generation an object of one of `kinds` belongs to (None: another object)."""
    name = key.rsplit("/", 1)[-1]
    kind, _, rest = name.partition("-")
    digits = rest.removesuffix(".json")
    return int(digits) if kind in kinds and rest.endswith(".json") and digits.isdigit() else None


class StorageLease:
    """The lease on `prefix` of `storage` for `holder`; a context manager that acquires it (or raises LeaseHeld),
    renews it on a thread and releases it. `ensure_held()` before every write under the protected prefix."""

    def __init__(self, storage: Storage, prefix: str, holder: Holder, *, fix: str = "wait for it to end",
                 lease_seconds: float = LEASE_SECONDS, renew_every: float = RENEW_EVERY, grace: float = CLOCK_GRACE):
        if not 0 < renew_every < lease_seconds:
            raise ValueError(f"renew_every {renew_every} must lie between 0 and lease_seconds {lease_seconds}")
        self.storage, self.prefix, self.holder, self.fix = storage, join_key(prefix), holder, fix
        self.lease_seconds, self.renew_every, self.grace = lease_seconds, renew_every, grace
        self.token = uuid.uuid4().hex
        self.generation: int | None = None
        self.lease_end = 0.0
        self._lost: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ---- the holder's side ---------------------------------------------------------------------------------
    def __enter__(self) -> StorageLease:
        self.acquire()
        self._renewer = threading.Thread(target=self._renew_until_stopped, name="lease-renewal", daemon=True)
        self._renewer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        self.release()

    def acquire(self) -> None:
        """Take the lease, waiting while a holder's lease runs out; LeaseHeld naming it if it renews meanwhile."""
        first_seen: LeaseState | None = None
        started = time.monotonic()
        while True:
            current = self._current()
            now = time.time()
            if current is not None and current.token == self.token:  # our create landed, its answer was lost
                self.generation, self.lease_end = current.generation, current.lease_end
                return
            if current is None or current.released or now >= current.lease_end + self.grace:
                if self._claim((current.generation if current else 0) + 1):
                    return
                continue  # another contender took that generation: read again
            renewed = first_seen is not None and (current.generation, current.lease_end) != (
                first_seen.generation, first_seen.lease_end)
            waited_out = time.monotonic() - started > self.lease_seconds + self.grace
            if renewed or waited_out:
                raise LeaseHeld(f"{self.storage.uri(self.prefix)} is in use by another run ({current.describe()}): "
                                f"{self.fix}")
            if first_seen is None:
                first_seen = current
                log.info("%s is held (%s); waiting to see whether its holder renews it",
                         self.storage.uri(self.prefix), current.describe())
            time.sleep(max(0.05, min(POLL_SECONDS, self.renew_every / 3, current.lease_end + self.grace - now)))

    def ensure_held(self) -> None:
        """Raise LeaseLost unless this holder's lease is live and no successor took it."""
        if self._lost is None and time.time() >= self.lease_end:
            self._lost = "it was not renewed before it ended"
        if self._lost is None and self._top_generation() != self.generation:
            self._lost = f"another run took it over ({self._current_description()})"
        if self._lost is not None:
            raise LeaseLost(f"the lease on {self.storage.uri(self.prefix)} is lost: {self._lost}; this run wrote "
                            f"nothing after that")

    def release(self) -> None:
        """Mark the lease released, so a successor need not wait for it to end (best effort: it ends anyway)."""
        if self.generation is None or self._lost is not None:
            return
        try:
            if self._top_generation() == self.generation:
                self._write_lease(time.time(), released=True)
        except StorageError as exc:
            log.warning("could not release the lease on %s (it ends by itself): %s", self.storage.uri(self.prefix),
                        exc)

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.renew_every):
            try:
                if self._top_generation() != self.generation:
                    self._lost = f"another run took it over ({self._current_description()})"
                else:
                    end = time.time() + self.lease_seconds
                    self._write_lease(end, released=False)
                    self.lease_end = end
            except StorageError as exc:  # the next tick tries again; past its end the lease is lost
                log.warning("could not renew the lease on %s: %s", self.storage.uri(self.prefix), exc)
            if self._lost is None and time.time() >= self.lease_end:
                self._lost = "it was not renewed before it ended"
            if self._lost is not None:
                log.error("the lease on %s is lost: %s", self.storage.uri(self.prefix), self._lost)
                return

    def _claim(self, generation: int) -> bool:
        """Create `generation` as ours; True when it is ours and still the highest."""
        end = time.time() + self.lease_seconds
        record = {"token": self.token, "holder": asdict(self.holder), "lease_end": end}
        key = join_key(self.prefix, _key("holder", generation))
        if not self.storage.create_bytes(key, json.dumps(record).encode()):
            return False
        if self._top_generation() != generation:  # created a generation below one already taken: not the lease
            return False
        self.generation, self.lease_end = generation, end
        older = [o.key for o in self.storage.list(dir_prefix(self.prefix))
                 if (_generation(o.key, ("holder", "lease")) or generation) < generation]
        try:
            self.storage.delete(older)
        except StorageError as exc:
            log.warning("could not delete earlier lease generations under %s: %s", self.storage.uri(self.prefix), exc)
        return True

    def _write_lease(self, end: float, released: bool) -> None:
        self.storage.write_json(join_key(self.prefix, _key("lease", self.generation)),
                                {"token": self.token, "lease_end": end, "released": released})

    # ---- reading the lease -----------------------------------------------------------------------------------
    def _top_generation(self) -> int:
        generations = [_generation(o.key) for o in self.storage.list(dir_prefix(self.prefix))]
        return max((g for g in generations if g is not None), default=0)

    def _current(self) -> LeaseState | None:
        """The highest generation, its holder and its lease end; None when nobody ever held the lease."""
        while True:
            top = self._top_generation()
            if top == 0:
                return None
            try:
                record = self.storage.read_json(join_key(self.prefix, _key("holder", top)))
            except NotFoundError:  # removed by the holder of a newer generation just now: read again
                continue
            try:
                lease = self.storage.read_json(join_key(self.prefix, _key("lease", top)))
            except NotFoundError:
                lease = {}
            renewed = lease.get("token") == record["token"]
            return LeaseState(top, record["token"], Holder(**record["holder"]),
                              max(record["lease_end"], lease["lease_end"] if renewed else 0.0),
                              renewed and bool(lease.get("released")))

    def _current_description(self) -> str:
        current = self._current()
        return current.describe() if current is not None else "nobody holds it now"
