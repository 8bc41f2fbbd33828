"""Running untrusted Python (a model's code and a problem's tests) in a subprocess that cannot do harm.

Every run gets a fresh empty working directory (deleted afterwards), a minimal environment, and limits on CPU
time (RLIMIT_CPU), address space (RLIMIT_AS), processes (RLIMIT_NPROC), file size (RLIMIT_FSIZE), open files
and wall-clock time (the whole process group is killed). The program comes in on stdin, so nothing about it
lies on disk for the code to rewrite. Two isolation levels:

- `namespaces` (root, with util-linux's `unshare` and `setpriv`): the kernel does the isolating. A new network
  namespace (no interfaces, not even a working loopback), a new PID namespace (when its first process ends,
  every process in it is killed: a fork bomb cannot outlive the run) and the unprivileged user `nobody`,
  which owns only the working directory.
- `audit` (otherwise): Python audit hooks only. They also refuse forking, signals to other processes and
  ctypes (so numpy, which loads ctypes, cannot be imported), but audit hooks are not a security boundary
  (code can reach the C level past them): this level keeps honest mistakes and naive escapes out, not a
  determined attacker.

In both levels an audit hook ends the run at the first attempt to write outside the working directory,
connect or bind a socket, resolve a host name or start another program (exit code `VIOLATION`), so such code
scores 0 even when it catches the error. The hook and the harness live in the same process as the code: code that
introspects the interpreter (frames, gc, re-initialising built-in modules) can get around the Python-level
checks; the namespaces level still holds it in.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

Isolation = Literal["namespaces", "audit"]
VIOLATION = 86  # exit code of a run the audit hook stopped
NOBODY = 65534
_STDERR_TAIL_BYTES = 2000


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_bytes: int = 1 << 30
    processes: int = 32  # of the sandbox's user; the namespaces level runs as `nobody`
    file_bytes: int = 16 << 20
    open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None: killed at the wall-clock limit; negative: killed by that signal
    timed_out: bool
    stderr_tail: str

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def violation(self) -> bool:
        return self.returncode == VIOLATION


@functools.cache
def available_isolation() -> Isolation:
    """`namespaces` where this process may create them (root, `unshare` and `setpriv` present and working)."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        return "audit"
    probe = subprocess.run([*_namespace_prefix(), "true"], capture_output=True, timeout=30)
    return "namespaces" if probe.returncode == 0 else "audit"


def _namespace_prefix() -> list[str]:
    return ["unshare", "--net", "--pid", "--fork", "--kill-child", "--",
            "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all", "--"]


def run_python(
    code: str, tests: str, limits: SandboxLimits = SandboxLimits(), isolation: Isolation | None = None
) -> SandboxResult:
    """Run `code`, then `tests` in the same namespace; passed when both ran without an exception."""
    isolation = isolation or available_isolation()
    payload = json.dumps({"code": code, "tests": tests, "limits": asdict(limits), "isolation": isolation})
    command = [sys.executable, "-I", "-B", "-c", _HARNESS]
    with tempfile.TemporaryDirectory(prefix="vime-sandbox-", ignore_cleanup_errors=True) as workdir, \
            tempfile.TemporaryFile() as stderr:
        if isolation == "namespaces":
            os.chown(workdir, NOBODY, NOBODY)
            command = [*_namespace_prefix(), *command]
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=stderr, start_new_session=True)
        try:
            proc.communicate(payload.encode(), timeout=limits.wall_seconds)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _end(proc, isolation == "namespaces")
        stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - _STDERR_TAIL_BYTES))
        tail = stderr.read().decode(errors="replace")
    return SandboxResult(None if timed_out else proc.returncode, timed_out, tail)


def _end(proc: subprocess.Popen, namespaced: bool, grace_s: float = 5.0) -> None:
    """Kill whatever of the run still lives and wait until nothing does."""
    if proc.poll() is None and namespaced:
        # `proc` is unshare; its child, the PID namespace's first process, is what to kill: as that one ends, the
        # kernel kills and reaps every other process of the namespace, and only then does unshare see it end.
        # (Killing unshare instead leaves that teardown to finish later, unwatched.)
        for pid in _children(proc.pid):
            _kill(pid)
    if proc.poll() is None:
        _signal_group(proc.pid)
    proc.wait()
    deadline = time.monotonic() + grace_s
    while _signal_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _signal_group(pgid: int) -> bool:
    """SIGKILL to the group; False when it has no process left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


# Runs in the sandboxed interpreter (`python -I -B -c`). It reads the program from stdin, lowers its own limits,
# installs the audit hook, removes os._exit (an exit with status 0 before the tests ran would read as a pass)
# and runs the code, then the tests; any exception, SystemExit included, is a failure.
_HARNESS = r'''
import builtins, json, os, posix, resource, sys

job = json.loads(sys.stdin.read())
sys.stdin = open(os.devnull)
limits = job["limits"]
for name, value in [("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_NPROC", limits["processes"]),
                    ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_NOFILE", limits["open_files"]),
                    ("RLIMIT_CORE", 0)]:
    resource.setrlimit(getattr(resource, name), (value, value))
# The soft limit sends SIGXCPU, which a PID namespace's first process ignores; the hard one kills.
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1))

def install_guard(workdir, namespaced, stop=os._exit, write=os.write, realpath=os.path.realpath,
                  fspath=os.fspath, sep=os.sep):
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    allowed = (workdir, os.devnull)
    spawning = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "os.forkpty",
                "pty.spawn", "os.startfile"}
    networking = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                  "socket.gethostbyname", "socket.gethostbyaddr", "socket.gethostbyname_ex"}
    if not namespaced:  # without the namespaces and another user, the kernel does not contain these
        spawning |= {"os.fork", "os.kill", "os.killpg", "signal.pthread_kill"}
    c_level = "ctypes." if not namespaced else None  # the way past audit hooks; numpy needs it
    one_path = {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                "os.mkfifo", "os.mknod", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr"}
    two_paths = {"os.rename", "os.link"}

    def inside(path):
        if isinstance(path, int):
            return True
        full = realpath(fspath(path))
        if isinstance(full, bytes):
            full = full.decode(errors="replace")
        return full in allowed or full.startswith(workdir + sep)

    def refuse(what):
        write(2, f"sandbox: refused {what}\n".encode(errors="replace"))
        stop(86)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (flags or 0) & write_flags or (mode and any(c in mode for c in "wax+"))
            if writing and path is not None and not inside(path):
                refuse(f"writing {path!r} outside the working directory")
        elif event in one_path:
            if not inside(args[0]):
                refuse(f"{event} {args[0]!r} outside the working directory")
        elif event in two_paths or event == "os.symlink":
            targets = args[1:2] if event == "os.symlink" else args[:2]
            if not all(inside(p) for p in targets):
                refuse(f"{event} {args[:2]!r} outside the working directory")
        elif event in networking:
            refuse(f"network access ({event})")
        elif event in spawning:
            refuse(f"starting or signalling processes ({event})")
        elif c_level and event.startswith(c_level):
            refuse(f"ctypes ({event})")

    sys.addaudithook(hook)

install_guard(os.path.realpath(os.getcwd()), job["isolation"] == "namespaces")
del os._exit, posix._exit
namespace = {"__name__": "__main__", "__builtins__": builtins}
try:
    exec(compile(job["code"], "solution.py", "exec"), namespace)
    exec(compile(job["tests"], "tests.py", "exec"), namespace)
except BaseException as exc:
    print(f"failed: {type(exc).__name__}: {str(exc)[:500]}", file=sys.stderr)
    sys.exit(1)
'''
