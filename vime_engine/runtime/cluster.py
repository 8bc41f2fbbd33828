"""Connecting to Ray: a private local cluster by default, or a given address.

A private local cluster listens on 127.0.0.1 only: Ray's single-node mode (its default on macOS and Windows)
gives the node the loopback address, and every Ray server binds that address instead of all interfaces.
Ray reads that switch once, when it is first imported, so an entry point calls `keep_local_ray_on_loopback`
before importing anything that imports Ray. A driver joining a cluster on a loopback address needs the same
switch: otherwise Ray rewrites 127.0.0.1 into the machine's interface address, where a head bound to loopback
never answers.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import psutil

from vime_engine.config.errors import ConfigError
from vime_engine.runtime.process_tree import end_processes

log = logging.getLogger(__name__)
SINGLE_NODE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": single-node mode on any platform
HEAD_ANSWER_TIMEOUT_S = 10.0  # a head that is starting answers within seconds; a dead port never does


class ClusterUnreachable(ConnectionError):
    """`--ray-address` does not answer: the cluster or its address is at fault, not the run (exit 3)."""


def head_host_port(address: str) -> tuple[str, int] | None:
    """The host and port a `--ray-address` names (`host:port` or `ray://host:port`); None for `auto`, which Ray
    resolves itself from the last cluster `ray start` left on this machine."""
    if address == "auto":
        return None
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"--ray-address {address}: expected HOST:PORT (e.g. 10.0.0.1:6379) or auto")
    return host.strip("[]"), int(port)


def is_loopback_address(address: str | None) -> bool:
    try:
        parsed = head_host_port(address) if address else None
    except ConfigError:  # refused with its message when the run joins (wait_for_head)
        return False
    if parsed is None:
        return False
    host = parsed[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: whatever it resolves to, the cluster is on the network
        return False


def keep_local_ray_on_loopback(address: str | None) -> None:
    """Before Ray is imported: a run without a cluster address gets a cluster bound to 127.0.0.1, and a run
    joining a cluster on a loopback address joins as a loopback node. A run that joins a cluster on the network
    keeps Ray's normal mode, where the other nodes reach this driver on its network address."""
    if (not address or is_loopback_address(address)) and "ray" not in sys.modules:
        os.environ.setdefault(SINGLE_NODE_SWITCH, "0")


def wait_for_head(address: str, timeout_s: float = HEAD_ANSWER_TIMEOUT_S) -> None:
    """Return once the head's port accepts a connection; raise `ClusterUnreachable` after `timeout_s`.

    `ray.init` retries an address that does not answer for minutes, printing nothing a user can act on; a
    TCP connect says within seconds whether anything listens there.
    """
    parsed = head_host_port(address)
    if parsed is None:
        return
    deadline, reason = time.monotonic() + timeout_s, "no answer"
    while True:
        try:
            with socket.create_connection(parsed, timeout=min(2.0, timeout_s)):
                return
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
        if time.monotonic() >= deadline:
            raise ClusterUnreachable(
                f"--ray-address {address}: nothing answers at {parsed[0]}:{parsed[1]} after {timeout_s:.0f} s "
                f"({reason}). Check that the head is running (`ray status --address {address}` on it), that the "
                "port is its GCS port (`ray start --head --port`, 6379 by default) and reachable from here, and, "
                "if the cluster uses token auth, that RAY_AUTH_TOKEN is the cluster's")
        time.sleep(0.5)


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
        wait_for_head(address)
        with _signal_handlers_kept():
            ray.init(address=address, log_to_driver=True)
        try:
            yield
        finally:
            ray.shutdown()
        return
    temp_dir = tempfile.mkdtemp(prefix="vimeflow-ray-", dir=os.environ.get("VIMEFLOW_RAY_TMP", "/tmp"))
    try:
        with _signal_handlers_kept():
            _start_private_cluster(temp_dir, num_cpus)
        yield
    finally:
        started = cluster_processes(temp_dir)  # before the shutdown: through the raylet, its agents and workers
        try:
            ray.shutdown()
        finally:  # a second Ctrl-C during the shutdown (runtime/preemption.py) still ends them
            end_processes(started)
            shutil.rmtree(temp_dir, ignore_errors=True)  # its session files (logs, sockets): nothing reads them


def _start_private_cluster(temp_dir: str, num_cpus: int | None) -> None:
    import ray

    with _head_without_unused_daemons():
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


@contextlib.contextmanager
def _head_without_unused_daemons() -> Iterator[None]:
    """While a private cluster's head starts, Ray does not start the two head processes a private cluster of a fixed
    size has no use for: the autoscaler's monitor (nothing to scale) and the API server that
    `ray.init(include_dashboard=False)` still starts (it serves the dashboard's, the job and the state APIs, none of
    which a run calls).

    Ray offers no switch for either, so the head's two starters (ray._private.node.Node, Ray pinned in
    pyproject.toml) do nothing for the duration. Started and then ended, as they were before, they cost every run
    the wait for the API server to answer and their imports on the cores the actors start on: ray.init took 1.7 s
    instead of 2.2-3.2 s on 2 cores, and the driver no longer imports the dashboard's dependencies either.
    """
    from ray._private.node import Node

    started = Node.start_monitor, Node.start_api_server
    Node.start_monitor = lambda self: None
    Node.start_api_server = lambda self, **_: None
    try:
        yield
    finally:
        Node.start_monitor, Node.start_api_server = started


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """`ray.init` installs SIGTERM handlers that exit the process at once (the driver's, and the head node's,
    which kills its processes first); afterwards the run's own handler (runtime/preemption.py) is put back, so
    SIGTERM checkpoints and exits 75 as it did before Ray started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cluster_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes of the private cluster in `temp_dir`: this process's children that run it (their command
    lines name the directory: the GCS, the raylet, the dashboard, the log monitor) and all that they started (the
    raylet's agents and workers, the actors' own children)."""
    roots = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if any(temp_dir in arg for arg in child.cmdline()):
                roots.append(child)
    found = list(roots)
    for root in roots:
        with contextlib.suppress(psutil.Error):
            found += root.children(recursive=True)
    return found
