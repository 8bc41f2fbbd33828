"""Ending the processes a run started: the private Ray cluster's after its shutdown, every one on a hard stop.

A Ray process that outlives its parent is out of reach of a tree walk, and some wait a long time before they
notice: the raylet's agents (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`) ran on for about 60 s after a start
of Ray that Ctrl-C had interrupted. So the processes are collected while their parents still live, and frozen
before they are killed. psutil checks a process's start time before it signals it, so a reused pid is never hit.
"""

from __future__ import annotations

import contextlib

import psutil

GRACE_S = 5.0


def end_processes(processes: list[psutil.Process], grace_s: float = GRACE_S) -> None:
    """SIGKILL whatever of `processes` is still running after `grace_s` (after a clean shutdown, none is), and wait
    for them to be gone."""
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=GRACE_S)


def end_descendants() -> int:
    """SIGKILL every descendant of this process at once, all of them frozen (SIGSTOP) first, so that none starts
    another meanwhile nor, its parent killed first, escapes as an orphan. Returns how many there were."""
    me = psutil.Process()
    frozen: dict[int, psutil.Process] = {}
    while new := [p for p in me.children(recursive=True) if p.pid not in frozen]:
        for process in new:
            with contextlib.suppress(psutil.Error):
                process.suspend()
            frozen[process.pid] = process
    end_processes(list(frozen.values()), grace_s=0)
    return len(frozen)
