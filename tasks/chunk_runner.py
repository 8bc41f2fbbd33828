"""The engine side of a pipeline stage, run as its own process: `python -m tasks.chunk_runner JOB.json`.

A stage runs the engine in a child process so that whatever happens to the engine (SIGTERM preemption, an
OOM kill, a crashed Ray actor) reaches the Prefect task as an exit code it can classify, instead of taking
the task's own process down. The job file names the mode and the flat engine values; the runner writes
`result.json` next to it and exits with one of the codes below. No Prefect here: the same command runs
inside a ModelArts container.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_CODE_ERROR = 1  # a bug: fail the task at once with the traceback
EXIT_CONFIG_ERROR = 2  # a configuration the engine refuses: fail at once with the engine's message
EXIT_INFRASTRUCTURE = 3  # a dead Ray actor or node, lost objects: worth another attempt
# 75 (EX_TEMPFAIL) = preempted after a checkpoint: vime_engine.runtime.preemption.PREEMPTED_EXIT_CODE

RESULT_FILE = "result.json"


def _infrastructure_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError", "NodeDiedError",
             "ObjectLostError", "OwnerDiedError", "RaySystemError", "OutOfMemoryError", "LocalRayletDiedError")
    return tuple(getattr(rex, n) for n in names if hasattr(rex, n))


def _train(cfg, job: dict[str, Any]) -> dict[str, Any]:
    from tasks.regression import reference_seconds
    from vime_engine import checkpoint as ckpt
    from vime_engine.chunk import run_chunk

    before = ckpt.find_latest(cfg.checkpoint.save, content=False)
    reference = reference_seconds()  # the machine's speed now, beside the step times this chunk logs
    result = run_chunk(cfg, int(job["start"]), int(job["count"]))
    return {**asdict(result), "resumed_from": before.rollout_id if before is not None else None,
            "reference_seconds": reference}


def _evaluate(cfg, job: dict[str, Any]) -> dict[str, Any]:
    from vime_engine.runtime.driver import train

    result = train(cfg)
    return {"eval_metrics": result.eval_metrics}


def run_job(job_path: Path) -> int:
    """Run the job; always leave result.json (value or error) and return the exit code."""
    from vime_engine.config import ConfigError, from_flat
    from vime_engine.runtime.preemption import Preempted

    job = json.loads(job_path.read_text())
    out = job_path.parent / RESULT_FILE
    t0 = time.perf_counter()

    def finish(code: int, **payload: Any) -> int:
        payload["engine_seconds"] = time.perf_counter() - t0
        out.write_text(json.dumps(payload, default=str))
        return code

    try:
        cfg = from_flat(job["flags"])
        value = (_train if job["mode"] == "train" else _evaluate)(cfg, job)
    except ConfigError as exc:
        return finish(EXIT_CONFIG_ERROR, error={"kind": "config", "message": str(exc)})
    except Preempted as exc:
        return finish(exc.exit_code, error={"kind": "preempted", "message": str(exc)})
    except _infrastructure_errors() as exc:
        return finish(EXIT_INFRASTRUCTURE, error={"kind": "infrastructure", "message": f"{type(exc).__name__}: {exc}"})
    except Exception as exc:  # noqa: BLE001  (anything else is a bug: report it whole)
        return finish(EXIT_CODE_ERROR, error={"kind": "code", "message": f"{type(exc).__name__}: {exc}",
                                              "traceback": traceback.format_exc()})
    return finish(EXIT_OK, value=value)


if __name__ == "__main__":
    sys.exit(run_job(Path(sys.argv[1])))
