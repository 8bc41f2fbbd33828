"""Guards of a run's checkpoints, shown by one real `vimeflow train` on the tiny model at `--lr 1e6` with a
reward that varies within each group (issue 28's divergence): a second run started on its `--save` while it runs is
refused at once, naming the holder (one writer per checkpoint directory); and the run stops at the rollout whose
gradient norm is NaN, exit 2, with every checkpoint on disk finite and LATEST on the last of them. A third run,
resuming from what it saved, is stopped by Ctrl-C during its start-up: it says so, exits 130, writes nothing and
leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from vime_engine.checkpoint.lock import LOCK_FILE
from vime_engine.checkpoint.run_history import HISTORY_FILE
from vime_engine.checkpoint.store import LATEST, find_latest, validate
from vime_engine.checkpoint.tensor_files import read_tensors
from vime_engine.train.torch_backend import MODEL_FILE, TRAINER_TENSORS_FILE

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Runs:
    save: Path
    out: Path
    first: subprocess.CompletedProcess
    first_pid: int
    second: subprocess.CompletedProcess
    second_out: Path
    second_seconds: float


def _train(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "train", *args]


def _holder_pid(lock: Path) -> int | None:
    try:
        return json.loads(lock.read_text())["pid"]
    except (OSError, ValueError, KeyError):  # not there yet, or being written
        return None


def _flags(tiny_model: Path, arithmetic_data: Path, save: Path) -> list[str]:
    return ["--hf-checkpoint", str(tiny_model), "--prompt-data", str(arithmetic_data), "--input-key", "question",
            "--label-key", "answer", "--apply-chat-template",
            "--custom-rm-path", f"{REPO / 'tests/support/tiny_task.py'}:digit_share",  # varies within a group
            "--num-rollout", "3", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--global-batch-size", "8", "--rollout-max-response-len", "8", "--vllm-kv-cache-gb", "0.25",
            "--lr", "1e6", "--save-interval", "1", "--save", str(save)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, arithmetic_data) -> Runs:
    run_dir = tmp_path_factory.mktemp("diverging")
    save, out = run_dir / "ckpt", run_dir / "out"
    flags = _flags(tiny_model, arithmetic_data, save)
    first = subprocess.Popen(_train(*flags, "--output-dir", str(out)), cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while _holder_pid(save / LOCK_FILE) != first.pid:  # past its preflight, about to start Ray
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        second_out = run_dir / "out-second"
        t0 = time.monotonic()
        second = subprocess.run(_train(*flags, "--output-dir", str(second_out)), cwd=REPO, capture_output=True,
                                text=True, timeout=120)
        second_seconds = time.monotonic() - t0
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    return Runs(save, out, subprocess.CompletedProcess(first.args, first.returncode, stdout, stderr), first.pid,
                second, second_out, second_seconds)


def test_a_second_run_on_the_same_save_is_refused_naming_the_holder(runs):
    second = runs.second
    assert second.returncode == 2, second.stdout + second.stderr
    assert (f"error: --save {runs.save} is in use by another run (pid {runs.first_pid} on host "
            f"{socket.gethostname()}; {LOCK_FILE} holds the lock)") in second.stderr
    assert "Traceback" not in second.stderr
    # Refused before its Ray started: its start-up is Python's and torch's imports and the preflight (3.7 s here on
    # a quiet machine; with the first run starting Ray and vLLM on the other core, about twice that).
    assert runs.second_seconds < 15, runs.second_seconds
    assert not runs.second_out.exists()  # nothing of its own written
    first = find_latest(runs.save)  # the first run's checkpoints are intact: manifests and checksums match
    assert first is not None and validate(first.path).rollout_id == 0


def test_a_diverged_run_stops_naming_rollout_and_metric_and_every_checkpoint_stays_finite(runs):
    first = runs.first
    assert first.returncode == 2, first.stdout + first.stderr
    message = first.stderr[first.stderr.index("error:"):]
    assert message.startswith("error: rollout 1 diverged: train/grad_norm = nan"), message
    assert "LATEST stays on the last finite checkpoint; lower --lr" in message and "Traceback" not in first.stderr
    saved = sorted(p for p in runs.save.iterdir() if p.name.startswith("rollout_"))
    assert [p.name for p in saved] == ["rollout_0000000"]  # the NaN step of rollout 1 never became a checkpoint
    for checkpoint in saved:
        ref = validate(checkpoint)
        for name in (MODEL_FILE, TRAINER_TENSORS_FILE):
            read_tensors(checkpoint / name, ref.manifest.files[name])  # raises on NaN or inf
    assert (runs.save / LATEST).read_text() == "rollout_0000000"
    trained = [json.loads(line) for line in (runs.out / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout_id"] for m in trained] == [0]  # the run's logs and metrics are kept


def _session(leader: int) -> list[psutil.Process]:
    """The processes of the session `leader` started (the run and all it started: Ray's processes and actors
    keep the driver's session; none calls setsid)."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(process.pid) == leader:
                found.append(process)
    return found


def _names(processes: list[psutil.Process]) -> set[str]:
    names = set()
    for process in processes:
        with contextlib.suppress(psutil.Error):
            names.add(process.name())
    return names


def test_ctrl_c_during_start_up_says_so_writes_nothing_and_leaves_no_process(runs, tmp_path, tiny_model,
                                                                                arithmetic_data):
    save = tmp_path / "ckpt"
    shutil.copytree(runs.save, save)  # the diverged run's finite checkpoint: this run resumes from it
    before = sorted(p.name for p in save.iterdir())
    run = subprocess.Popen(_train(*_flags(tiny_model, arithmetic_data, save), "--output-dir", str(tmp_path / "out")),
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        # Ray is starting: the raylet has started its agents (which a Ctrl-C here used to leave running for 60 s)
        while "ray::DashboardAgent" not in _names(_session(run.pid)):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        stdout, stderr = run.communicate(timeout=120)
        left = _names(_session(run.pid))
    finally:
        for process in _session(run.pid):  # only this run's, should the test fail
            with contextlib.suppress(psutil.Error):
                process.kill()
    assert run.returncode == 130, stdout + stderr
    assert not left, left  # the agents included, at the moment the driver exits
    assert ("Ctrl-C: stopping when the start-up step in progress ends (Ray's start, the workers' start, loading a "
            "checkpoint); nothing is trained and no checkpoint is written; press Ctrl-C again") in stdout
    assert "stopped by Ctrl-C during start-up; nothing trained, no checkpoint written" in stdout
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stdout + stderr
    assert sorted(p.name for p in save.iterdir()) == before  # nothing written, not even a staged save
    assert (save / LATEST).read_text() == "rollout_0000000" and find_latest(save).rollout_id == 0
    assert (save / HISTORY_FILE).stat().st_size > 0
