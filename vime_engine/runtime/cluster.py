"""Connecting to Ray: a private local cluster by default, or a given address.

A private local cluster listens on 127.0.0.1 only: Ray's single-node mode (its default on macOS and Windows)
gives the node the loopback address, and every Ray server binds that address instead of all interfaces.
Ray reads that switch once, when it is first imported, so an entry point calls `keep_local_ray_on_loopback`
before importing anything that imports Ray.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

log = logging.getLogger(__name__)
SINGLE_NODE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": single-node mode on any platform


def keep_local_ray_on_loopback(address: str | None) -> None:
    """Before Ray is imported: a run without a cluster address gets a cluster bound to 127.0.0.1. A run that
    joins a cluster keeps Ray's normal mode, where the other nodes reach this driver on its network address."""
    if not address and "ray" not in sys.modules:
        os.environ.setdefault(SINGLE_NODE_SWITCH, "0")


@contextlib.contextmanager
def ray_cluster(address: str | None = None, num_cpus: int | None = None) -> Iterator[None]:
    """Start (or join) Ray for the duration of the block; a cluster we started is shut down after it.

    A plain `ray.init()` may attach to a stale cluster left by another process, so without an address we
    always start a private one with its own temp dir.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        temp_dir = tempfile.mkdtemp(prefix="vimeflow-ray-", dir=os.environ.get("VIMEFLOW_RAY_TMP", "/tmp"))
        ray.init(
            address="local", _temp_dir=temp_dir, include_dashboard=False, log_to_driver=True,
            num_cpus=num_cpus or max(4, os.cpu_count() or 1),
            _system_config={
                # No task table: the GCS keeps every task's events (up to 100k, ~500 B each) for the dashboard and
                # `ray list tasks`, which a private cluster has no use for; a long run's GCS grew with it
                # (bench/soak.py).
                "task_events_report_interval_ms": 0,
                # No idle workers started with the driver: our actors carry a runtime env, so none of them would
                # be used. On 2 cores under load ray.init took 15.4 s with them and 11.2 s without (means of 5
                # alternated runs); a whole tiny `vimeflow train` on a quiet machine did not change (27.9 vs 27.1 s).
                "prestart_worker_first_driver": False,
            },
        )
        node_ip = ray.util.get_node_ip_address()
        if not ipaddress.ip_address(node_ip).is_loopback:
            log.warning("the local Ray cluster listens on %s, not only on 127.0.0.1: Ray was imported before "
                        "keep_local_ray_on_loopback(None) was called", node_ip)
    try:
        yield
    finally:
        ray.shutdown()
