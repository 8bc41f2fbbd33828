"""Infrastructure vs code failures of an engine job: what the runner's exit code says about an exception, what
the task makes of an exit, and a real raylet killed under a tiny run, which must come back as a retryable
InfrastructureFailure (it used to end as `EngineCodeFailure: engine exit 1 without a result`)."""

from __future__ import annotations

import ipaddress
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray.exceptions as rex

from tasks.engine_job.messages import LOST, EngineError, TrainJob
from tasks.engine_job.runner import (
    EXIT_CODE_ERROR, EXIT_CONFIG_ERROR, EXIT_INFRASTRUCTURE, exit_code_for, is_infrastructure_error,
)
from tasks.engine_job.process import (
    EngineCodeFailure, EngineConfigFailure, InfrastructureFailure, failure_for_exit, run_engine_job,
)
from vime_engine.config import ConfigError
from vime_engine.runtime.preemption import PREEMPTED_EXIT_CODE, Preempted

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "tests" / "support" / "faults"
RAYLET_DIES_AT_PUT = 4  # the driver's 4th ray.put: after the first rollout's metrics are out
# Ray's per-node agents notice a dead raylet only after a minute or two, then exit by themselves.
SLOW_AGENTS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent"}
OBJECT = "a" * 56  # an object ref's hex


def _raised_from(cause: BaseException) -> RuntimeError:
    try:
        try:
            raise cause
        except BaseException as exc:
            raise RuntimeError("rollout failed") from exc
    except RuntimeError as wrapped:
        return wrapped


EXCEPTIONS = {
    "actor died": (rex.ActorDiedError(), EXIT_INFRASTRUCTURE),
    "actor error": (rex.RayActorError(), EXIT_INFRASTRUCTURE),
    "actor unavailable": (rex.ActorUnavailableError("socket closed", None), EXIT_INFRASTRUCTURE),
    "worker crashed": (rex.WorkerCrashedError(), EXIT_INFRASTRUCTURE),
    "node died": (rex.NodeDiedError("node 1 marked dead"), EXIT_INFRASTRUCTURE),
    "object lost": (rex.ObjectLostError(OBJECT, None, ""), EXIT_INFRASTRUCTURE),
    "owner died": (rex.OwnerDiedError(OBJECT, None, ""), EXIT_INFRASTRUCTURE),
    "ray's OOM kill": (rex.OutOfMemoryError("task killed: memory above 0.95"), EXIT_INFRASTRUCTURE),
    "ray system error": (rex.RaySystemError("raylet connection lost"), EXIT_INFRASTRUCTURE),
    "local raylet died": (rex.LocalRayletDiedError(), EXIT_INFRASTRUCTURE),
    "raised from a dead actor": (_raised_from(rex.ActorDiedError()), EXIT_INFRASTRUCTURE),
    "a task's dead actor": (rex.RayTaskError("generate", "tb", rex.ActorDiedError()).as_instanceof_cause(),
                            EXIT_INFRASTRUCTURE),
    "a task's own bug": (rex.RayTaskError("generate", "tb", ValueError("bad shape")).as_instanceof_cause(),
                         EXIT_CODE_ERROR),
    "an actor's constructor raised": (rex.RayActorError(actor_init_failed=True), EXIT_CODE_ERROR),
    "a bug": (KeyError("rollout/raw_reward"), EXIT_CODE_ERROR),
    "configuration": (ConfigError("--lr must be > 0"), EXIT_CONFIG_ERROR),
    "preempted": (Preempted(3, None), PREEMPTED_EXIT_CODE),
}


@pytest.mark.parametrize("case", EXCEPTIONS)
def test_the_runner_exit_code_of_each_failure(case):
    exc, code = EXCEPTIONS[case]
    assert exit_code_for(exc) == code
    assert is_infrastructure_error(exc) is (code == EXIT_INFRASTRUCTURE)


UNREPORTED = EngineError(kind=LOST, message="the engine process ended without reporting")
EXITS = {
    "preempted": (PREEMPTED_EXIT_CODE, EngineError(kind="preempted", message="after rollout 3"),
                  InfrastructureFailure, "after rollout 3"),
    "ray infrastructure": (EXIT_INFRASTRUCTURE, EngineError(kind="infrastructure", message="ActorDiedError"),
                           InfrastructureFailure, "ActorDiedError"),
    "SIGKILL (OOM killer)": (-signal.SIGKILL, UNREPORTED, InfrastructureFailure, "SIGKILL"),
    "137 through a shell": (128 + signal.SIGKILL, None, InfrastructureFailure, "SIGKILL"),
    "ended unreported (raylet died)": (1, UNREPORTED, InfrastructureFailure, "without reporting"),
    "configuration": (EXIT_CONFIG_ERROR, EngineError(kind="config", message="--lr must be > 0"),
                      EngineConfigFailure, "--lr must be > 0"),
    "a bug": (EXIT_CODE_ERROR, EngineError(kind="code", message="KeyError: 'x'", traceback="Traceback … KeyError"),
              EngineCodeFailure, "Traceback … KeyError"),
    "the runner never started": (1, None, EngineCodeFailure, "before the runner started"),
}


@pytest.mark.parametrize("case", EXITS)
def test_what_the_task_makes_of_each_exit(case):
    code, error, failure, text = EXITS[case]
    got = failure_for_exit(code, error)
    assert type(got) is failure and text in str(got)


def _listening_addresses(procs: list[psutil.Process]) -> set[str]:
    found = set()
    for proc in procs:
        try:
            found |= {c.laddr.ip for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:  # ended meanwhile
            pass
    return found


def _engine_tree() -> list[psutil.Process]:
    """The `tasks.engine_job.runner` child of this process and everything under it (not the session's servers)."""
    for child in psutil.Process(os.getpid()).children():
        try:
            if "tasks.engine_job.runner" in child.cmdline():
                return [child, *child.children(recursive=True)]
        except psutil.Error:
            pass
    return []


# Ray's head processes that a private cluster does not start (runtime/cluster.py): the autoscaler's monitor and the
# API server.
UNUSED_DAEMONS = ("ray/autoscaler/_private/monitor.py", "ray/dashboard/dashboard.py")


def _unused_daemons_running(procs: list[psutil.Process]) -> list[str]:
    """The command lines of the UNUSED_DAEMONS among `procs`."""
    running = []
    for proc in procs:
        try:
            if any(arg.endswith(UNUSED_DAEMONS) for arg in proc.cmdline()):
                running.append(" ".join(proc.cmdline()))
        except psutil.Error:  # ended meanwhile
            pass
    return running


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:  # ended meanwhile
        return ""


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def test_a_raylet_killed_under_a_run_is_a_retryable_infrastructure_failure(tmp_path, tiny_model, arithmetic_data,
                                                                         monkeypatch):
    """The raylet dies (as under the OOM killer) just before the driver puts the next batch into the object
    store: Ray ends the driver from below Python with exit 1, which used to fail the chunk as a code error."""
    marker = tmp_path / "fault.marker"
    monkeypatch.setenv("PYTHONPATH", f"{FAULTS}{os.pathsep}{REPO}")
    monkeypatch.setenv("VIMEFLOW_TEST_FAULT", f"ray:put:{RAYLET_DIES_AT_PUT}")
    monkeypatch.setenv("VIMEFLOW_TEST_FAULT_VICTIM", "raylet")
    monkeypatch.setenv("VIMEFLOW_TEST_FAULT_MARKER", str(marker))
    flags = {
        "hf-checkpoint": str(tiny_model), "prompt-data": str(arithmetic_data), "input-key": "question",
        "label-key": "answer", "apply-chat-template": True,
        "custom-rm-path": str(REPO / "tests/support/tiny_task.py") + ":digit_share",
        "num-rollout": 20, "rollout-batch-size": 2, "n-samples-per-prompt": 2, "rollout-max-response-len": 8,
        "vllm-kv-cache-gb": 0.25, "save": str(tmp_path / "ckpt"), "output-dir": str(tmp_path / "out"),
    }
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            run_engine_job(TrainJob(flags=flags, start=0, count=20), tmp_path / "job")
        except BaseException as exc:  # noqa: BLE001  (what the task sees)
            outcome["error"] = exc

    runner = threading.Thread(target=run)
    runner.start()
    engine_tree: list[psutil.Process] = []  # the engine process and its descendants: its Ray cluster
    while runner.is_alive() and not any(_name(p).startswith(("ray::Rollout", "ray::Colocated")) for p in engine_tree):
        time.sleep(0.2)  # until the actors exist: by then every Ray server of the cluster listens
        engine_tree = _engine_tree()
    listening = _listening_addresses(engine_tree)
    unused_daemons = _unused_daemons_running(engine_tree)
    runner.join(timeout=300)
    assert not runner.is_alive(), "the engine went on without its raylet"
    assert marker.is_file(), f"the raylet was never killed: {outcome.get('error')!r}"
    assert isinstance(outcome.get("error"), InfrastructureFailure), repr(outcome.get("error"))
    assert "without reporting an outcome" in str(outcome["error"])
    assert listening and all(_is_loopback(ip) for ip in listening), f"the local cluster listens on {listening}"
    assert not unused_daemons, f"Ray's autoscaler monitor or API server still runs: {unused_daemons}"
    try:  # the actors and the cluster's servers follow their driver; nothing keeps memory for the next attempt
        deadline = time.monotonic() + 30
        while (left := [_name(p) for p in engine_tree if p.is_running() and _name(p) not in SLOW_AGENTS]) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"left running: {left}"
    finally:
        for proc in engine_tree:
            if proc.is_running():
                proc.kill()
