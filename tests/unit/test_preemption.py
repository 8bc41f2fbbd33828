"""SIGTERM and Ctrl-C stop a run at a safe point; a second Ctrl-C stops it at once (vime_engine/runtime/preemption.py).
Real signals, sent to this process or to a small one that holds the guard; tests/component/test_cli_run_guards.py
presses Ctrl-C on a real `vimeflow train` during its start-up."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from vime_engine.checkpoint import store as ckpt
from vime_engine.runtime.preemption import (
    INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, Preempted, PreemptionGuard,
)

REPO = Path(__file__).resolve().parents[2]


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_ctrl_c_during_start_up_is_announced_and_stops_it_with_exit_130_and_the_handlers_come_back(caplog):
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING), PreemptionGuard(save=None) as guard:
        os.kill(os.getpid(), signal.SIGINT)
        _wait_for(lambda: guard.requested is not None)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal that is not Ctrl-C changes nothing
        time.sleep(0.1)
        with pytest.raises(Preempted) as stopped:
            guard.stop_if_requested()
    assert guard.requested == signal.SIGINT and stopped.value.exit_code == INTERRUPTED_EXIT_CODE == 130
    assert str(stopped.value) == "stopped by Ctrl-C during start-up; nothing trained, no checkpoint written"
    assert caplog.messages == [
        "Ctrl-C: stopping when the start-up step in progress ends (Ray's start, the workers' start, loading a "
        "checkpoint); nothing is trained and no checkpoint is written; press Ctrl-C again to stop at once"]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_what_a_signal_during_a_rollout_announces_and_sigterm_keeps_its_exit_75(tmp_path):
    guard = PreemptionGuard(save=tmp_path)
    guard.phase = "rollout 3"
    assert guard.plan(signal.SIGTERM) == ("SIGTERM: finishing rollout 3, then writing its checkpoint and exiting; "
                                          "press Ctrl-C again to stop at once, without it")
    assert PreemptionGuard(save=None).plan(signal.SIGINT).startswith("Ctrl-C: stopping when the start-up step")
    without_save = PreemptionGuard(save=None)
    without_save.phase = "rollout 0"
    assert "then exiting (no --save: no checkpoint)" in without_save.plan(signal.SIGINT)
    assert Preempted(3, None).exit_code == PREEMPTED_EXIT_CODE == 75
    assert str(Preempted(3, None)) == "preempted after rollout 3; no checkpoint (--save not set)"


# A process standing in for a run: a child with a grandchild (as the raylet has its agents), a committed
# checkpoint and a save under way, then Ctrl-C twice.
HOLDER = textwrap.dedent("""
    import json, os, signal, subprocess, sys, time
    from pathlib import Path
    import psutil
    from vime_engine.checkpoint import store as ckpt
    from vime_engine.runtime.preemption import PreemptionGuard

    root = Path(sys.argv[1])
    done = ckpt.staging_dir(root, 0)
    (done / "model.safetensors").write_bytes(b"weights")
    ckpt.commit(root, done, 0, {"rollout_id": 0}, None)
    staged = ckpt.staging_dir(root, 1)
    (staged / "model.safetensors").write_bytes(b"half")
    child = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    with PreemptionGuard(root, say_stopped=lambda message: print(message, flush=True)) as guard:
        guard.phase = "rollout 1"
        while not psutil.Process(child.pid).children():
            time.sleep(0.01)
        print(json.dumps([child.pid, *(p.pid for p in psutil.Process(child.pid).children())]), flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    print("not stopped", flush=True)
""")


def test_a_second_ctrl_c_ends_every_process_of_the_run_removes_the_save_under_way_and_exits_130(tmp_path):
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    seconds = time.monotonic() - t0
    assert run.returncode == 130, run.stdout + run.stderr
    pids, message = json.loads(run.stdout.splitlines()[0]), run.stdout.splitlines()[-1]
    assert message == ("stopped at once by a second Ctrl-C during rollout 1 (2 processes of the run ended): "
                       "rollout 1 is not saved; the checkpoints already written are whole")
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.LATEST, "rollout_0000000"]  # the staged save went
    assert ckpt.validate(tmp_path / "rollout_0000000").rollout_id == 0
    assert seconds < 20, seconds  # not the 30 s it sleeps
