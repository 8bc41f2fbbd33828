"""`python -m vime_engine.rollout.server.server_guard PARENT_PID COMMAND...`: run a server so that nothing it starts
outlives it.

vLLM's API server runs its engine core as a process of its own (`VLLM::EngineCore`, on CPU too), which does not
notice its server's death: a SIGKILLed server left its engine core (and multiprocessing's resource tracker) running
for hours. The guard starts COMMAND in a session of its own and waits for it; however COMMAND ends (a SIGKILL
included), the guard then SIGKILLs COMMAND's whole process group, which its children inherit. A SIGTERM to the guard
(ServerProcess.stop, or the kernel's parent-death signal when the engine's actor dies) is passed on to the group,
which gets GRACE_S to shut down before it is SIGKILLed. COMMAND dies with the guard too (its own parent-death
signal), should the guard itself be SIGKILLed.

Only the standard library: the guard starts in tens of milliseconds and holds a few megabytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int) -> None:
    """Have the kernel send this process `sig` when its parent dies (Linux's parent-death signal)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def exit_code(returncode: int) -> int:
    """A child's return code as the shell reports it: a death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def main(parent: int, command: list[str]) -> int:
    # The guard waits for signals instead of handling them: SIGCHLD (the server ended) and SIGTERM (stop).
    watched = {signal.SIGTERM, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the signal was armed
        return 1

    def as_server() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
        die_with_parent(signal.SIGKILL)

    server = subprocess.Popen(command, start_new_session=True, preexec_fn=as_server)
    kill_at = None  # once stopping: when the group gets SIGKILL
    while server.poll() is None:
        if kill_at is None:
            received = signal.sigwait(watched)
        else:
            received = signal.sigtimedwait(watched, max(0.0, kill_at - time.monotonic()))
            received = received.si_signo if received else None
            if received is None:  # past the grace: SIGKILL, again each second until the server is gone
                _signal_group(server.pid, signal.SIGKILL)
                kill_at = time.monotonic() + 1.0
        if received == signal.SIGTERM and kill_at is None:
            _signal_group(server.pid, signal.SIGTERM)
            kill_at = time.monotonic() + GRACE_S
    # The group outlives its leader while any member lives, and its id is not reused meanwhile.
    _signal_group(server.pid, signal.SIGKILL)
    return exit_code(server.returncode)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
