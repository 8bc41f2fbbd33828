"""One writer per checkpoint directory (vime_engine/checkpoint/lock.py): a second run is refused at once, naming
the holder's pid and host, and the kernel releases the lock of a holder that dies, however it dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.engine_job.runner import EXIT_CONFIG_ERROR, exit_code_for
from vime_engine.checkpoint.lock import LOCK_FILE, CheckpointDirLocked, describe_holder, exclusive_writer

REPO = Path(__file__).resolve().parents[2]
HOLD = "import sys, time\nfrom vime_engine.checkpoint.lock import exclusive_writer\n" \
       "with exclusive_writer(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)\n"


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    save = tmp_path / "ckpt"
    with exclusive_writer(save):
        with pytest.raises(CheckpointDirLocked) as refused, exclusive_writer(save):
            pass
        (save / "rollout_0000000").mkdir()  # a checkpoint: the directory and its lock file stay afterwards
    assert str(refused.value) == (f"--save {save} is in use by another run (pid {os.getpid()} on host "
                                  f"{socket.gethostname()}; {LOCK_FILE} holds the lock): wait for it to end, or "
                                  "give this run another --save directory")
    assert exit_code_for(refused.value) == EXIT_CONFIG_ERROR
    assert (save / LOCK_FILE).is_file()
    with exclusive_writer(save):  # free again once the holder left
        pass


def test_the_lock_of_a_killed_holder_is_released_by_the_kernel(tmp_path):
    save = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(save)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(CheckpointDirLocked, match=f"pid {holder.pid} on host "), exclusive_writer(save):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with exclusive_writer(save):  # no stale lock: nothing to clean up by hand
        assert describe_holder((save / LOCK_FILE).read_bytes()).startswith(f"pid {os.getpid()} ")


def test_a_directory_the_run_made_and_left_empty_is_removed_again(tmp_path):
    made, given = tmp_path / "made" / "ckpt", tmp_path / "given"
    given.mkdir()
    for directory in (made, given):
        with exclusive_writer(directory):
            assert (directory / LOCK_FILE).is_file()
    assert not made.exists() and (tmp_path / "made").is_dir()  # only what the run made
    assert given.is_dir() and list(given.iterdir()) == []


def test_a_lock_file_being_written_or_foreign_reads_as_an_unknown_holder():
    assert describe_holder(b'{"pid": 12, "host": "gpu-7"}') == "pid 12 on host gpu-7"
    for record in (b"", b'{"pid": 12', b"[1, 2]", b'{"host": "h"}'):
        assert describe_holder(record) == "a process that has not written its pid yet"
