"""One writer under a storage prefix (tasks/storage/lease.py) on real clients over HTTP: boto3 and the OBS SDK against
the moto server (whose S3 create-only PUT also serves OBS's forbid-overwrite header, tests/support/s3_fixtures.py).
Leases of a second or two stand in for the pipeline's minutes; nothing here trains."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.storage import Storage, open_storage
from tasks.storage.lease import Holder, LeaseHeld, LeaseLost, StorageLease

REPO = Path(__file__).resolve().parents[2]
LEASE = dict(lease_seconds=2.0, renew_every=0.3, grace=0.3)
PREFIX = "runs/r1/chunk-lock"


def _open(kind: str, endpoint: str, bucket: str, tmp_path: Path) -> Storage:
    if kind == "file":
        return open_storage((tmp_path / "store").as_uri())
    if kind == "s3":
        return open_storage(f"s3://{bucket}", endpoint_url=endpoint, addressing_style="path", retry_base_delay=0.01)
    return open_storage(f"obs://{bucket}", server=endpoint, retry_base_delay=0.01)


def _lease(storage: Storage, run: str, **kw) -> StorageLease:
    return StorageLease(storage, PREFIX, Holder(run=run, host="node-a", pid=4242), **{**LEASE, **kw})


@pytest.mark.parametrize("kind", ["file", "s3", "obs"])
def test_create_bytes_writes_only_where_no_object_is(kind, moto_endpoint, make_bucket, tmp_path):
    storage = _open(kind, moto_endpoint, make_bucket(), tmp_path)
    assert storage.create_bytes("a/holder.json", b"first")
    assert not storage.create_bytes("a/holder.json", b"second")
    assert storage.get_bytes("a/holder.json") == b"first"
    assert [o.key for o in storage.list("a/")] == ["a/holder.json"]


@pytest.mark.parametrize("kind", ["s3", "obs"])
def test_a_second_run_is_refused_naming_the_holder_and_takes_over_once_released(kind, moto_endpoint, make_bucket,
                                                                                tmp_path):
    storage = _open(kind, moto_endpoint, make_bucket(), tmp_path)
    with _lease(storage, "flow run 'first', chunk from rollout 0"):
        second = _lease(storage, "flow run 'second', chunk from rollout 0", fix="wait for it to end")
        t0 = time.monotonic()
        with pytest.raises(LeaseHeld) as refused:
            second.acquire()
        # refused once it saw the holder renew: well before the holder's lease could end
        assert time.monotonic() - t0 < LEASE["lease_seconds"]
        message = str(refused.value)
        for part in (f"{storage.uri(PREFIX)} is in use by another run", "flow run 'first', chunk from rollout 0",
                     "host node-a", "pid 4242", "lease until 20", "UTC", "wait for it to end"):
            assert part in message, message
    t0 = time.monotonic()
    with _lease(storage, "flow run 'second'") as second:  # released: no wait
        assert time.monotonic() - t0 < LEASE["lease_seconds"]  # an unreleased lease would hold it that long
        assert second.generation == 2
        # the earlier generation's objects are gone, the lease's own remain
        assert {o.key.rsplit("/", 1)[1] for o in storage.list(PREFIX + "/")} <= {"holder-00000002.json",
                                                                                 "lease-00000002.json"}


HOLD_FOREVER = """
import sys, time
from tasks.storage import open_storage
from tasks.storage.lease import Holder, StorageLease
kind, endpoint, bucket, prefix = sys.argv[1:5]
options = {"endpoint_url": endpoint, "addressing_style": "path"} if kind == "s3" else {"server": endpoint}
storage = open_storage(f"{kind}://{bucket}", **options)
with StorageLease(storage, prefix, Holder("flow run 'preempted'", "node-b", 1), lease_seconds=2.0, renew_every=0.3,
                  grace=0.3):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("kind", ["s3", "obs"])
def test_a_killed_holders_lease_is_taken_over_once_it_ended(kind, moto_endpoint, make_bucket, storage_env, tmp_path):
    bucket = make_bucket()
    storage = _open(kind, moto_endpoint, bucket, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_FOREVER, kind, moto_endpoint, bucket, PREFIX],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        time.sleep(2 * LEASE["renew_every"])  # renewed at least once
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # a preempted node: no release, no more renewals
        holder.wait()
    killed = time.time()
    last_renewal_end = storage.read_json(PREFIX + "/lease-00000001.json")["lease_end"]
    assert last_renewal_end > killed  # the dead holder's lease was still running
    with _lease(storage, "flow run 'successor'") as successor:
        assert time.time() >= last_renewal_end + LEASE["grace"]  # not before the lease ended
        assert successor.generation == 2
        successor.ensure_held()


@pytest.mark.parametrize("kind", ["s3", "obs"])
def test_a_holder_that_cannot_renew_loses_its_lease_and_is_stopped_before_writing(kind, fault_proxy, moto_endpoint,
                                                                                   make_bucket, tmp_path):
    bucket = make_bucket()
    direct = _open(kind, moto_endpoint, bucket, tmp_path)
    first = _lease(_open(kind, fault_proxy.url, bucket, tmp_path), "flow run 'cut-off'")  # renews through the proxy
    first.__enter__()
    fault_proxy.fail(10_000, match=lambda method, path, query: method == "PUT" and "lease-" in path)
    with _lease(direct, "flow run 'successor'") as successor:  # waited for the first lease to end
        assert successor.generation == 2
        with pytest.raises(LeaseLost, match="is lost: it was not renewed before it ended"):
            first.ensure_held()  # what train_chunk calls before writing to the storage root
        first.__exit__(None, None, None)  # the loser ends: it must not release the successor's lease
        with pytest.raises(LeaseHeld, match="flow run 'successor'"):
            _lease(direct, "flow run 'third'").acquire()
