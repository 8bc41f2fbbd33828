"""Connecting to Ray: a private local cluster by default, or a given address."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


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
        )
    try:
        yield
    finally:
        ray.shutdown()
