"""Run one engine job (`tasks.engine_job.runner`) as a child process and turn its exit into a typed outcome.

Exit code → what the Prefect task does:
  0                   the job's value
  75 (preempted)      InfrastructureFailure: retried (the engine checkpointed before leaving)
  3 (a dead Ray actor, raylet or node, lost objects, Ray's OOM kill), killed by a signal (the OOM killer, a
  lost node: -9, or 137 through a shell), or ended without reporting (Ray ends its driver when the local
  raylet or object store dies)                          InfrastructureFailure: retried
  2 (config)          EngineConfigFailure: fails at once with the engine's message
  1 / anything else   EngineCodeFailure: fails at once with the traceback

The child gets PR_SET_PDEATHSIG=SIGKILL, so a killed flow process never leaves an engine training on behind
its back (a re-run would otherwise race it for the same checkpoint directory).

The child's stdout and stderr (its own, Ray's, and every Ray worker's and vLLM engine's, which Ray forwards to
the driver) go to a log file, appended to across attempts; a failure names the file. `STREAM_ENGINE_OUTPUT`=1
in the environment (`vimeflow run --verbose`) streams them to the console instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tasks.engine_job.messages import (
    LOST, RESULT_FILE, EngineError, EvaluateResult, Job, TrainResult, read_report, write_job,
)
from tasks.engine_job.runner import EXIT_CONFIG_ERROR, EXIT_INFRASTRUCTURE, EXIT_OK
from tasks.retry_policy import retry_on
from tasks.storage.errors import TransientStorageError
from vime_engine.runtime.preemption import PREEMPTED_EXIT_CODE

REPO_ROOT = Path(__file__).resolve().parent.parent
STREAM_ENGINE_OUTPUT = "VIMEFLOW_STREAM_ENGINE_OUTPUT"
ENGINE_LOG = "engine.log"
RolloutCallback = Callable[[int, dict[str, Any]], None]


class EngineFailure(RuntimeError):
    """The engine process did not finish its job; `log_file` holds its output (None: it went to the console)."""

    log_file: Path | None = None

    @property
    def summary(self) -> str:
        """The message's last line (before the log's name): for a traceback, the exception that ended the engine."""
        lines = [line for line in str(self).splitlines() if line.strip() and not line.startswith("(engine log: ")]
        return lines[-1] if lines else type(self).__name__


class InfrastructureFailure(EngineFailure):
    """Preemption, a killed process, a dead Ray actor, a storage 5xx: another attempt may succeed."""


class EngineConfigFailure(EngineFailure):
    """The engine refused the configuration; retrying cannot help."""


class EngineCodeFailure(EngineFailure):
    """An error in code; retrying cannot help."""


@dataclass(frozen=True)
class EngineRun:
    value: TrainResult | EvaluateResult  # the job's result type (read as that type: a train job's is a TrainResult)
    engine_seconds: float  # measured inside the child: the engine's own time, start-up included
    wall_seconds: float  # measured here: child process start to exit


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _watch_metrics(path: Path, on_record: RolloutCallback, stop: threading.Event) -> None:
    """Report every new metrics.jsonl record once (the file is rewritten on resume, so track ids, not offsets)."""
    seen: set[tuple[int, bool]] = set()

    def scan() -> None:
        if not path.is_file():
            return
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line being written right now
                continue
            key = (int(record.get("rollout_id", -1)), "rollout/raw_reward" in record)
            if key not in seen:
                seen.add(key)
                on_record(key[0], record)

    if path.is_file():  # records of earlier attempts are history, not progress
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                seen.add((int(r.get("rollout_id", -1)), "rollout/raw_reward" in r))
            except json.JSONDecodeError:
                pass
    while not stop.wait(0.5):
        scan()
    scan()


def streams_engine_output() -> bool:
    return os.environ.get(STREAM_ENGINE_OUTPUT) == "1"


def run_chunk_runner(job_path: Path, output: IO[str] | None = None) -> int:
    """`tasks.engine_job.runner` on `job_path` in a child process (its output to `output`, None: ours); its exit code.

    A child, because Ray ends its driver process from below Python when the local raylet or object store dies:
    the caller lives on to read the child's result.json and call that a lost engine, not a code error.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "tasks.engine_job.runner", str(job_path)], env=env,
                          preexec_fn=_die_with_parent, check=False, stdout=output, stderr=output).returncode


def run_engine_job(job: Job, job_dir: Path, metrics_file: Path | None = None,
                   on_record: RolloutCallback | None = None, log_file: Path | None = None) -> EngineRun:
    """Write the job, run the child, classify its exit. `on_record` sees each new metrics record; the child's
    output goes to `log_file` (default `job_dir/engine.log`) unless the engine output is streamed."""
    import time

    job_path = write_job(job_dir, job)
    (job_dir / RESULT_FILE).unlink(missing_ok=True)
    stop = threading.Event()
    watcher = None
    if metrics_file is not None and on_record is not None:
        watcher = threading.Thread(target=_watch_metrics, args=(metrics_file, on_record, stop), daemon=True)
        watcher.start()
    log_file = None if streams_engine_output() else (log_file or job_dir / ENGINE_LOG)
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as files:
            output = None
            if log_file is not None:
                log_file.parent.mkdir(parents=True, exist_ok=True)
                output = files.enter_context(log_file.open("a"))
                output.write(f"=== {job.mode} job {job_path} started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
                output.flush()
            returncode = run_chunk_runner(job_path, output)
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(timeout=5)
    wall = time.perf_counter() - t0
    report = read_report(job_dir, job)
    if returncode == EXIT_OK and report is not None and report.value is not None:
        return EngineRun(report.value, report.engine_seconds, wall)
    failure = failure_for_exit(returncode, report.error if report is not None else None)
    if log_file is not None:
        failure.log_file = log_file
        failure.args = (f"{failure}\n(engine log: {log_file})",)
    raise failure


def failure_for_exit(code: int, error: EngineError | None) -> EngineFailure:
    """What a job that did not deliver its value means, from its exit code and the error its result.json reports
    (None: the runner reported none, e.g. it never started because Python could not import it)."""
    if code in (PREEMPTED_EXIT_CODE, EXIT_INFRASTRUCTURE):
        return InfrastructureFailure(f"engine exit {code}: {error.message if error else 'no message'}")
    if code < 0 or code == 128 + signal.SIGKILL:
        number = -code if code < 0 else code - 128
        return InfrastructureFailure(f"engine killed by signal {signal.Signals(number).name} (exit {code}): "
                                     "the OOM killer, a lost node or an operator")
    if error is not None and error.kind == LOST:
        return InfrastructureFailure(
            f"engine exit {code} without reporting an outcome: the process was ended from below Python, as Ray "
            "ends its driver when the local raylet or object store dies (see the engine log)")
    if code == EXIT_CONFIG_ERROR:
        return EngineConfigFailure(error.message if error else "configuration error")
    if error is None:
        return EngineCodeFailure(f"engine exit {code} before the runner started (see its output)")
    return EngineCodeFailure(error.traceback or error.message)


# Prefect retry condition: retry only what another attempt can fix.
is_infrastructure_failure = retry_on(InfrastructureFailure, TransientStorageError)
