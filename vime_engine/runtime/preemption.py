"""Preemption: SIGTERM asks the run to finish its current step, checkpoint, and exit with a known code."""

from __future__ import annotations

import signal
import threading

# EX_TEMPFAIL from sysexits.h: "try again later". Orchestrators retry this code; any other non-zero is a failure.
PREEMPTED_EXIT_CODE = 75


class Preempted(Exception):
    """Raised after the checkpoint of `rollout_id` was written in answer to SIGTERM."""

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, rollout_id: int, checkpoint) -> None:
        where = f"checkpoint {checkpoint.path}" if checkpoint is not None else "no checkpoint (--save not set)"
        super().__init__(f"preempted after rollout {rollout_id}; {where}")
        self.rollout_id = rollout_id
        self.checkpoint = checkpoint


class PreemptionGuard:
    """Within the block, SIGTERM only sets `requested`; the previous handler comes back afterwards."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
