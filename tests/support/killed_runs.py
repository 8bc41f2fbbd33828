"""`vimeflow train` as a subprocess, optionally SIGKILLed inside a chosen function call (tests/support/faults/
sitecustomize.py injects the kill into whichever process of the run makes the call): the machinery of the
kill-and-resume tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "tests" / "support" / "faults"


def run_train(config: Path, fault: str | None = None, command: list[str] | None = None, timeout: int = 240) -> int:
    """Run `vimeflow train --config config` (or `command`) in `config`'s directory's log; with `fault`
    ("module:Qualified.name:N"), wait for the injected kill and reap the whole run."""
    env = {**os.environ, "PYTHONPATH": f"{FAULTS}{os.pathsep}{REPO}"}
    marker = config.parent / "fault.marker"
    marker.unlink(missing_ok=True)
    if fault:
        env.update(VIMEFLOW_TEST_FAULT=fault, VIMEFLOW_TEST_FAULT_MARKER=str(marker))
    cmd = command or [sys.executable, "-m", "flows.cli", "train", "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                            stdout=open(config.parent / "log.txt", "a"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and not (fault and marker.exists()):
        time.sleep(0.05)
    if fault and marker.exists():
        # The process that hit the fault is dead (it may be the driver itself); take the rest of the run.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _kill_stragglers(marker)
        return -signal.SIGKILL
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"run did not finish in {timeout}s; see {config.parent / 'log.txt'}")
    if fault:
        pytest.fail(f"fault {fault} never triggered; see {config.parent / 'log.txt'}")
    return proc.returncode


def _kill_stragglers(marker: Path) -> None:
    """The killed run's processes outside its process group, which a dead machine or container would take along:
    Ray's actors (each in a group of its own; they exit on their raylet's death, but not at once) and what they
    started, such as the multiprocessing manager Megatron's checkpoint writer starts in each rank, which never
    exits once its rank and that rank's raylet are gone."""
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get("VIMEFLOW_TEST_FAULT_MARKER") == str(marker):
                process.kill()
