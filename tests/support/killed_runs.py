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
import yaml

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "tests" / "support" / "faults"


def write_config(run_dir: Path, base: dict, **overrides) -> Path:
    """`base` with the run's own checkpoint and output directories (and `overrides`) as `run_dir`/config.yaml."""
    values = {**base, "save": str(run_dir / "ckpt"), "output-dir": str(run_dir / "out"), **overrides}
    path = run_dir / "config.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(values))
    return path


def start_train(config: Path, fault: str | None = None, victim: str | None = None,
                command: list[str] | None = None) -> tuple[subprocess.Popen, Path]:
    """Start `vimeflow train --config config` (or `command`), its output appended to `config`'s directory's log;
    with `fault` ("module:Qualified.name:N") and `victim` (VIMEFLOW_TEST_FAULT_VICTIM) as sitecustomize.py reads
    them. Returns the process and the fault's marker file."""
    env = {**os.environ, "PYTHONPATH": f"{FAULTS}{os.pathsep}{REPO}"}
    marker = config.parent / "fault.marker"
    for stale in (marker, marker.with_name(marker.name + ".resume")):
        stale.unlink(missing_ok=True)
    if fault:
        env.update(VIMEFLOW_TEST_FAULT=fault, VIMEFLOW_TEST_FAULT_MARKER=str(marker))
    if victim:
        env["VIMEFLOW_TEST_FAULT_VICTIM"] = victim
    cmd = command or [sys.executable, "-m", "flows.cli", "train", "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                            stdout=open(config.parent / "log.txt", "a"), stderr=subprocess.STDOUT)
    return proc, marker


def kill_run(proc: subprocess.Popen, marker: Path) -> None:
    """SIGKILL the whole run: its process group, then its processes outside it (`_kill_stragglers`)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _kill_stragglers(marker)


def run_train(config: Path, fault: str | None = None, command: list[str] | None = None, timeout: int = 240) -> int:
    """Run `vimeflow train` (or `command`); with `fault`, wait for the injected kill and reap the whole run."""
    proc, marker = start_train(config, fault, command=command)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and not (fault and marker.exists()):
        time.sleep(0.05)
    if fault and marker.exists():
        # The process that hit the fault is dead (it may be the driver itself); take the rest of the run.
        kill_run(proc, marker)
        return -signal.SIGKILL
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"run did not finish in {timeout}s; see {config.parent / 'log.txt'}")
    if fault:
        pytest.fail(f"fault {fault} never triggered; see {config.parent / 'log.txt'}")
    return proc.returncode


def _kill_stragglers(marker: Path) -> None:
    """The killed run's processes outside its process group (they carry the marker's path in their environment, which
    every process of a run started with `fault` inherits), which a dead machine or container would take along:
    Ray's actors (each in a group of its own; they exit on their raylet's death, but not at once) and what they
    started, such as the multiprocessing manager Megatron's checkpoint writer starts in each rank, which never
    exits once its rank and that rank's raylet are gone."""
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get("VIMEFLOW_TEST_FAULT_MARKER") == str(marker):
                process.kill()
