"""The engine side of a pipeline stage, run as its own process: `python -m tasks.engine_job.runner JOB.json`.

A stage runs the engine in a child process so that whatever happens to the engine (SIGTERM preemption, an
OOM kill, a crashed Ray actor) reaches the Prefect task as an exit code it can classify, instead of taking
the task's own process down. The job file (a TrainJob or an EvaluateJob, tasks/engine_job/messages.py) holds the
flat engine values; the runner writes its JobReport to `result.json` next to it and exits with one of the codes
below. No Prefect here: the same command runs inside a ModelArts container.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from pathlib import Path

from tasks.engine_job.messages import (
    LOST, RESULT_FILE, EngineError, EvaluateResult, JobReport, TrainJob, TrainResult, read_job, write_report,
)

EXIT_OK = 0
EXIT_CODE_ERROR = 1  # a bug: fail the task at once with the traceback
EXIT_CONFIG_ERROR = 2  # a configuration the engine refuses: fail at once with the engine's message
EXIT_INFRASTRUCTURE = 3  # a dead Ray actor, raylet or node, lost objects, Ray's OOM kill, a silent head: retried
# 75 (EX_TEMPFAIL) = preempted after a checkpoint: vime_engine.runtime.preemption.PREEMPTED_EXIT_CODE

# Ray losing a process, node or object under the job (ray.exceptions): nothing the job's code did.
RAY_INFRASTRUCTURE_ERRORS = (
    "RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError", "NodeDiedError",
    "ObjectLostError", "OwnerDiedError", "RaySystemError", "OutOfMemoryError", "LocalRayletDiedError",
)


def is_infrastructure_error(exc: BaseException) -> bool:
    """Whether the failure, or an error it was raised from or while handling (a Ray task error's cause
    included), is Ray infrastructure failing under the job. An actor whose constructor raised is not: that
    is the constructor's code."""
    rex = sys.modules.get("ray.exceptions")
    if rex is None:  # Ray never imported: no Ray failure
        return False
    infrastructure = tuple(getattr(rex, name) for name in RAY_INFRASTRUCTURE_ERRORS if hasattr(rex, name))
    todo, seen = [exc], set()
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, rex.RayActorError) and error.actor_init_failed:
            continue
        if isinstance(error, infrastructure):
            return True
        todo += [error.__cause__, error.__context__, getattr(error, "cause", None)]
    return False


def exit_code_for(exc: Exception) -> int:
    """The runner's exit code for a job that raised `exc`."""
    from vime_engine.config import ConfigError
    from vime_engine.runtime.cluster import ClusterUnreachable
    from vime_engine.runtime.preemption import Preempted

    if isinstance(exc, ConfigError):
        return EXIT_CONFIG_ERROR
    if isinstance(exc, Preempted):
        return exc.exit_code
    if isinstance(exc, ClusterUnreachable) or is_infrastructure_error(exc):
        return EXIT_INFRASTRUCTURE
    return EXIT_CODE_ERROR


def _error_report(code: int, exc: Exception) -> EngineError:
    if code == EXIT_CONFIG_ERROR:  # raised in a Ray worker: the worker's error, not Ray's traceback around it
        return EngineError(kind="config", message=str(getattr(exc, "cause", None) or exc))
    if code == EXIT_CODE_ERROR:  # a bug: report it whole
        return EngineError(kind="code", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    return EngineError(kind="preempted" if code != EXIT_INFRASTRUCTURE else "infrastructure",
                       message=f"{type(exc).__name__}: {exc}")


def _train(cfg, job: TrainJob) -> TrainResult:
    from tasks.engine_job.speed_probe import reference_seconds
    from vime_engine.checkpoint import store as ckpt
    from vime_engine.chunk import run_chunk

    before = ckpt.find_latest(cfg.checkpoint.save, content=False)
    reference = reference_seconds()  # the machine's speed now, beside the step times this chunk logs
    result = run_chunk(cfg, job.start, job.count)
    return TrainResult(**result.model_dump(), resumed_from=before.rollout_id if before is not None else None,
                       reference_seconds=reference)


def _evaluate(cfg) -> EvaluateResult:
    from vime_engine.chunk import evaluate_checkpoint

    return EvaluateResult(eval_metrics=evaluate_checkpoint(cfg))


def run_job(job_path: Path) -> int:
    """Run the job; always leave result.json (value or error) and return the exit code.

    Until the job ends, result.json says the job was lost: a process ended from below Python (Ray ends its
    driver when the local raylet or object store dies) leaves exactly that behind.
    """
    out = job_path.parent / RESULT_FILE
    t0 = time.perf_counter()

    def finish(code: int, value: TrainResult | EvaluateResult | None = None, error: EngineError | None = None) -> int:
        write_report(out, JobReport(engine_seconds=time.perf_counter() - t0, value=value, error=error))
        return code

    finish(EXIT_INFRASTRUCTURE, error=EngineError(kind=LOST, message="the engine process ended without reporting"))
    try:
        from vime_engine.runtime.cluster import keep_local_ray_on_loopback

        job = read_job(job_path)
        keep_local_ray_on_loopback(job.flags.get("ray-address"))  # before anything imports Ray
        from vime_engine.config import from_flat

        cfg = from_flat(job.flags)
        value = _train(cfg, job) if isinstance(job, TrainJob) else _evaluate(cfg)
    except Exception as exc:  # noqa: BLE001  (every outcome is reported; its code says what it was)
        code = exit_code_for(exc)
        return finish(code, error=_error_report(code, exc))
    return finish(EXIT_OK, value=value)


def show_engine_progress() -> None:
    """The engine's own INFO lines (resumed from, placed on Ray, saved) go to stdout: the job's log, where the
    task, the ModelArts job log or `--verbose` show them. Only the engine's: other libraries keep their levels."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    engine = logging.getLogger("vime_engine")
    engine.setLevel(logging.INFO)
    engine.addHandler(handler)


if __name__ == "__main__":
    show_engine_progress()
    sys.exit(run_job(Path(sys.argv[1])))
