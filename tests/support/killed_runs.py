"""Runs of `vimeflow train` as a user starts them, killed with SIGKILL inside a chosen function call where a test
asks (tests/support/faults/sitecustomize.py injects the kill into whichever process of the run makes that call)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "tests" / "support" / "faults"


def write_config(run_dir: Path, base: dict, **overrides) -> Path:
    values = {**base, "save": str(run_dir / "ckpt"), "output-dir": str(run_dir / "out"), **overrides}
    path = run_dir / "config.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(values))
    return path


def run_train(config: Path, fault: str | None = None, command: list[str] | None = None, timeout: int = 240) -> int:
    """Run `vimeflow train` (or `command`); with `fault`, wait for the injected kill and reap the whole group."""
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
        kill_stragglers(marker)
        return -signal.SIGKILL
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"run did not finish in {timeout}s; see {config.parent / 'log.txt'}")
    if fault:
        pytest.fail(f"fault {fault} never triggered; see {config.parent / 'log.txt'}")
    return proc.returncode


def kill_stragglers(marker: Path) -> None:
    """The killed run's processes outside its process group, which a dead machine or container would take along:
    Ray's actors (each in a group of its own; they exit on their raylet's death, but not at once) and what they
    started, such as the multiprocessing manager Megatron's checkpoint writer starts in each rank, which never
    exits once its rank and that rank's raylet are gone."""
    import psutil

    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get("VIMEFLOW_TEST_FAULT_MARKER") == str(marker):
                process.kill()
