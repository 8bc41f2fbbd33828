"""`--rm-type code`: real subprocesses running a response's code against tests; every escape scores 0 and the
next response is scored as usual. Each escape is tried at every isolation level this machine has."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from vime_engine.rewards import BUILTIN_REWARDS, extract_answer
from vime_engine.rewards.code import code_reward, extract_code
from vime_engine.rewards.sandbox import NOBODY, SandboxLimits, available_isolation, run_python

LEVELS = ["audit"] + (["namespaces"] if available_isolation() == "namespaces" else [])
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
GOOD = "def add(a, b):\n    return a + b\n"
QUICK = SandboxLimits(cpu_seconds=1, wall_seconds=2.0, processes=16)


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution:\n```{tag}\n{code}```\nDone."


@pytest.mark.parametrize(
    ("response", "code"),
    [(fenced("x = 1\n"), "x = 1\n"), (fenced("a\n", "py") + fenced("b\n", ""), "b\n"),
     (fenced("print(1)\n") + fenced("ls -l\n", "bash"), "print(1)\n"), ("def add(a, b): return a + b", None),
     (fenced("x\n", "text"), None)],
)
def test_extract_code_takes_the_last_python_block(response, code):
    assert extract_code(response) == code


def test_code_reward_runs_the_tests_against_the_code():
    assert BUILTIN_REWARDS["code"] is code_reward
    assert code_reward(fenced(GOOD), TESTS) == 1.0
    assert code_reward(fenced("def add(a, b):\n    return a - b\n"), TESTS) == 0.0
    assert code_reward(fenced("def add(a, b) return a + b\n"), TESTS) == 0.0  # syntax error
    assert code_reward(GOOD, TESTS) == 0.0  # no code block
    # leaving before the tests run is not passing them
    assert code_reward(fenced("import sys\nsys.exit(0)\n"), TESTS) == 0.0
    assert code_reward(fenced("import os\nos._exit(0)\n"), TESTS) == 0.0
    assert extract_answer("code", fenced(GOOD)) == GOOD


def test_writing_inside_the_working_directory_is_allowed():
    code = GOOD + "open('scratch.txt', 'w').write('kept')\nassert open('scratch.txt').read() == 'kept'\n"
    assert code_reward(fenced(code), TESTS) == 1.0


@pytest.mark.parametrize("level", LEVELS)
def test_writing_outside_its_directory_scores_zero(level, tmp_path):
    for target in [Path("/tmp") / f"vime-escape-{uuid.uuid4().hex}", tmp_path / "escape.txt"]:
        for attempt in (f"open({str(target)!r}, 'w').write('x')", f"import os\nos.mkdir({str(target)!r})",
                        f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')"):
            code = f"try:\n    {attempt.replace(chr(10), chr(10) + '    ')}\nexcept Exception:\n    pass\n" + GOOD
            result = run_python(code, TESTS, QUICK, level)
            assert result.violation and not result.passed, (attempt, result)
            assert not target.exists()
    escaped = f"../vime-escape-{uuid.uuid4().hex}"  # the parent of the working directory
    assert run_python(f"open({escaped!r}, 'w').write('x')\n" + GOOD, TESTS, QUICK, level).violation
    assert not (Path("/tmp") / escaped[3:]).exists()


@pytest.fixture
def listener():
    """A real TCP server on 127.0.0.1 that records every connection it accepts."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[bytes] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(1)
                accepted.append(conn.recv(100))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@pytest.mark.parametrize("level", LEVELS)
def test_connecting_out_scores_zero_even_when_the_error_is_caught(level, listener):
    port, accepted = listener
    code = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'out')\n"
            f"except Exception:\n    pass\n" + GOOD)
    result = run_python(code, TESTS, QUICK, level)
    assert result.violation and "network" in result.stderr_tail
    raw = (f"import socket\ns = socket.socket()\ntry:\n    s.connect(('127.0.0.1', {port}))\n"
           "except Exception:\n    pass\n")
    assert run_python(raw + GOOD, TESTS, QUICK, level).violation
    time.sleep(0.3)
    assert accepted == []


@pytest.mark.skipif("namespaces" not in LEVELS, reason="needs root with unshare and setpriv: the kernel level")
def test_past_the_audit_hook_the_network_namespace_still_holds(listener):
    """ctypes calls connect() in C, where no audit hook sees it: the empty network namespace refuses it."""
    port, accepted = listener
    code = f"""
import ctypes, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
address = struct.pack("=H", socket.AF_INET) + struct.pack("!H", {port}) + socket.inet_aton("127.0.0.1") + bytes(8)
assert libc.connect(fd, address, len(address)) == -1 and ctypes.get_errno() != 0, "connected"
""" + GOOD
    result = run_python(code, TESTS, QUICK, "namespaces")
    assert result.passed, result.stderr_tail  # the hook never saw it, and the connection never happened
    time.sleep(0.3)
    assert accepted == []


def _sandbox_processes() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == NOBODY:
                pids.append(int(entry.name))
        except OSError:  # ended while we looked
            pass
    return pids


@pytest.mark.parametrize("level", LEVELS)
def test_a_fork_bomb_scores_zero_and_leaves_nothing_behind(level):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    started = time.monotonic()
    result = run_python(bomb + GOOD, TESTS, QUICK, level)
    assert not result.passed
    assert time.monotonic() - started < QUICK.wall_seconds + 5  # + the teardown of every process it made
    if level == "namespaces":  # forks until RLIMIT_NPROC; the PID namespace takes them all down with it
        assert _sandbox_processes() == []
    else:
        assert result.violation
    assert code_reward(fenced(GOOD), TESTS) == 1.0  # and the next response is scored as usual


@pytest.mark.parametrize("level", LEVELS)
def test_limits_on_cpu_memory_time_and_programs(level):
    cases = {
        "cpu": "while True:\n    pass\n",
        "memory": "hoard = bytearray(4 << 30)\n",
        "wall clock": "import time\ntime.sleep(60)\n",
        "another program": "import subprocess\nsubprocess.run(['true'])\n",
        "file size": "open('big', 'wb').write(b'x' * (64 << 20))\n",
    }
    for name, code in cases.items():
        started = time.monotonic()
        result = run_python(code + GOOD, TESTS, QUICK, level)
        assert not result.passed, name
        # A limit ended it: unlimited, the loop never ends and the sleep takes 60 s. The margin is the sandbox's
        # start and teardown on a loaded machine (4.01 s for the CPU case under the suite's two workers on 2 cores).
        assert time.monotonic() - started < QUICK.wall_seconds + 10, name
    assert run_python(GOOD, TESTS, QUICK, level).passed


def test_the_sandbox_runs_as_nobody_without_network_where_it_can():
    if "namespaces" not in LEVELS:
        pytest.skip("needs root with unshare and setpriv")
    probe = (f"import os, socket\nassert os.getuid() == {NOBODY}\nassert socket.if_nameindex() in ([], [(1, 'lo')])\n"
             "assert os.listdir('.') == []\n")
    assert run_python(probe, "", QUICK, "namespaces").passed
