"""The server's guard (vime_engine/rollout/server/server_guard.py): nothing a guarded server started outlives it, the
way vLLM's engine core outlived a SIGKILLed server. Real processes: a "server" that starts a child of its own and
waits, as vLLM's API server does with its engine core."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

# Starts a grandchild (the "engine core", a sleep) and prints its pid, then sleeps itself.
SERVER = ("import subprocess, sys, time; core = subprocess.Popen([sys.executable, '-c', 'import time; "
          "time.sleep(120)']); print(core.pid, flush=True); time.sleep(120)")


@pytest.fixture
def started():
    """The processes a test started; whatever of them a failed test leaves running is killed after it."""
    processes: list[psutil.Process] = []
    yield processes
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()


def _guarded(started: list) -> tuple[subprocess.Popen, psutil.Process, psutil.Process]:
    """A guard running SERVER: the guard, the server and its child."""
    guard = subprocess.Popen([sys.executable, "-m", "vime_engine.rollout.server.server_guard", str(os.getpid()),
                              sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    core = psutil.Process(int(guard.stdout.readline()))
    started += [psutil.Process(guard.pid), psutil.Process(core.ppid()), core]
    return guard, *started[-2:]


def _gone(process: psutil.Process, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_a_sigkilled_server_takes_its_children_with_it_and_the_guard_reports_the_kill(started):
    guard, server, core = _guarded(started)
    server.kill()
    assert guard.wait(timeout=10) == 128 + signal.SIGKILL
    assert _gone(core), "the server's child outlived it"


def test_a_sigterm_to_the_guard_ends_the_server_and_its_children(started):
    guard, server, core = _guarded(started)
    guard.send_signal(signal.SIGTERM)
    assert guard.wait(timeout=15) == 128 + signal.SIGTERM  # the server ended by the SIGTERM passed on
    assert _gone(server) and _gone(core)


def test_the_guards_parent_dying_ends_the_server_and_its_children(started):
    # The guard's parent is a shell that waits for it, as the engine's actor does, until SIGKILLed.
    shell = subprocess.Popen(["sh", "-c", f'{sys.executable} -m vime_engine.rollout.server.server_guard $$ '
                                          f'{sys.executable} -c "{SERVER}" & wait'],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    core = psutil.Process(int(shell.stdout.readline()))
    server = psutil.Process(core.ppid())
    guard = psutil.Process(server.ppid())
    started += [psutil.Process(shell.pid), guard, server, core]
    assert guard.ppid() == shell.pid
    shell.kill()  # SIGKILL: only the guard's parent-death signal is left to end the rest
    shell.wait()
    assert _gone(guard) and _gone(server) and _gone(core)
