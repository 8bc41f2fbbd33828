"""Stopping a run on a signal: SIGTERM (a scheduler's preemption notice) and SIGINT (Ctrl-C) ask the run to stop
at its next safe point, with a known exit code; a second Ctrl-C stops it at once.

A safe point is the end of the rollout in progress, which is then checkpointed, or, during start-up (the
preflight, Ray's start, the workers' start, a resume's load), the end of the start-up step in progress, with
nothing trained and no checkpoint written; the run's teardown (the workers, then the cluster) runs either way.
Ctrl-C in the middle of Ray's start had ended the driver with Ray's agents left running for a minute.

The signals are read by a thread of the guard's (`signal.set_wakeup_fd`), not by Python's handlers: those run
only when the main thread returns to Python, which it does not while `ray.init` waits inside Ray's C++ core (a
Ctrl-C there was announced 10 s late, and a second one merged with the first). The hard stop of a second Ctrl-C
kills every process the run started and exits: the checkpoints already written stay whole (each is renamed into
place only once its manifest is written), and a save under way is removed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# EX_TEMPFAIL from sysexits.h: "try again later". Orchestrators retry this code; any other non-zero is a failure.
PREEMPTED_EXIT_CODE = 75
# What shells report for a process that Ctrl-C ended. Not 75: the pipeline retries 75 (tasks/engine_job), and a
# person's Ctrl-C asks for a stop, not for another attempt.
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
START_UP = "start-up"


def _by_whom(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


class Preempted(Exception):
    """Raised at a safe point after SIGTERM or SIGINT: after the checkpoint of `rollout_id` (None: during start-up,
    before anything was trained)."""

    def __init__(self, rollout_id: int | None, checkpoint, signum: int = signal.SIGTERM) -> None:
        if rollout_id is None:
            done = "during start-up; nothing trained, no checkpoint written"
        else:
            where = (f"checkpoint {checkpoint.path} (the same command resumes from it)" if checkpoint is not None
                     else "no checkpoint (--save not set)")
            done = f"after rollout {rollout_id}; {where}"
        what = "preempted" if signum == signal.SIGTERM else f"stopped by {_by_whom(signum)}"
        super().__init__(f"{what} {done}")
        self.rollout_id = rollout_id
        self.checkpoint = checkpoint
        self.exit_code = INTERRUPTED_EXIT_CODE if signum == signal.SIGINT else PREEMPTED_EXIT_CODE


def _noted(signum: int, frame) -> None:
    """Python's handler for the stop signals: nothing, so that neither raises in the main thread; the guard's
    thread has acted on the signal already."""


class PreemptionGuard:
    """Within the block, the first SIGTERM or SIGINT sets `requested` (its number) and says on the engine's log
    (`vimeflow train` shows its warnings on the terminal) what the run does next; a SIGINT after it stops the run at
    once: every process this one started is killed, this run's unfinished save under `save` removed, `say_stopped`
    (default: the log) told why, and the process exits 130. The previous handlers come back afterwards.

    The driver tells the guard what the run is doing (`phase`: start-up, or the rollout in progress) and calls
    `stop_if_requested` where start-up can stop cleanly.
    """

    def __init__(self, save: str | Path | None, say_stopped: Callable[[str], None] | None = None) -> None:
        self.save = save
        self.say_stopped = say_stopped or (lambda message: log.warning("%s", message))
        self.phase = START_UP
        self.requested: int | None = None
        self._previous: dict[int, object] = {}
        self._pipe: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._watcher: threading.Thread | None = None

    def plan(self, signum: int) -> str:
        """What the run does after `signum`, in one line."""
        if self.phase == START_UP:
            then = ("stopping when the start-up step in progress ends (Ray's start, the workers' start, loading a "
                    "checkpoint); nothing is trained and no checkpoint is written")
        else:
            then = f"finishing {self.phase}, then " + ("writing its checkpoint and exiting" if self.save else
                                                       "exiting (no --save: no checkpoint)")
        return f"{_by_whom(signum)}: {then}; press Ctrl-C again to stop at once" + (
            "" if self.phase == START_UP else ", without it")

    def stop_if_requested(self) -> None:
        """During start-up: end the run here if a signal asked for it."""
        if self.requested is not None:
            raise Preempted(None, None, self.requested)

    def _on_signal(self, signum: int) -> None:
        if self.requested is None:
            self.requested = signum
            log.warning("%s", self.plan(signum))
        elif signum == signal.SIGINT:
            self._stop_at_once()

    def _stop_at_once(self) -> None:
        from vime_engine.checkpoint.store import discard_staged
        from vime_engine.runtime.process_tree import end_descendants

        ended = end_descendants()  # Ray's processes, the actors, vLLM: their writes into a save end with them
        if self.save is not None:
            discard_staged(self.save)
        lost = "nothing was trained" if self.phase == START_UP else f"{self.phase} is not saved"
        self.say_stopped(f"stopped at once by a second Ctrl-C during {self.phase} ({ended} processes of the run "
                         f"ended): {lost}; the checkpoints already written are whole")
        os._exit(INTERRUPTED_EXIT_CODE)

    def _watch(self, read_fd: int) -> None:
        while data := os.read(read_fd, 64):  # one byte per signal; empty once the guard closes the pipe
            for signum in data:
                if signum in STOP_SIGNALS:
                    self._on_signal(signum)

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is not threading.main_thread():  # signal handlers live on the main thread
            return self
        read_fd, write_fd = self._pipe = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd's requirement: a full pipe must not block a handler
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, _noted)
        self._previous_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, args=(read_fd,), name="stop-signals", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        read_fd, write_fd = self._pipe
        os.close(write_fd)  # the watcher reads the end of the pipe and returns
        self._watcher.join(timeout=5)
        os.close(read_fd)
