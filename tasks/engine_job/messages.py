"""The messages across the engine-process boundary, one type each, and the one place they are written and read.

  job.json     the flow side → the runner (tasks.engine_job.runner): a TrainJob or an EvaluateJob
  result.json  the runner → the flow side: a JobReport, holding the job's TrainResult / EvaluateResult or an
               EngineError
  OBS          the submitter → the ModelArts head: a ChunkSpec; the head → the submitter: a CommittedChunk

Each is a frozen pydantic model that refuses unknown fields and reads no number from a string (strict), so a
missing or mistyped field fails where the file is read (`decode`: a MessageError naming the file and each bad field)
instead of as a KeyError somewhere past it. The JSON keeps the keys of the dicts these replace (TrainResult is
the engine's ChunkResult plus what the runner adds, flat). Each attempt writes its own: a resumed chunk reads
from an earlier attempt only its checkpoints (vime_engine/checkpoint/) and their history
(tasks/engine_job/checkpoint_history.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError, model_validator

from tasks.engine_job.layout import EngineJob, run_prefix
from tasks.storage import join_key
from vime_engine.chunk import ChunkResult

JOB_FILE = "job.json"
RESULT_FILE = "result.json"
MESSAGE_CONFIG = ConfigDict(frozen=True, extra="forbid", strict=True)

# How a job failed. `lost` is what result.json holds while the job runs: still there at the end = the process
# died unreported (Ray ends its driver from below Python when the local raylet or object store dies).
LOST = "lost"
ErrorKind = Literal["lost", "config", "code", "preempted", "infrastructure"]


class Message(BaseModel):
    model_config = MESSAGE_CONFIG


class MessageError(ValueError):
    """A message that does not parse: where it came from and each field that is missing, unknown or mistyped."""


M = TypeVar("M", bound=BaseModel)


def decode(kind: type[M], data: bytes | str | dict[str, Any], where: str) -> M:
    """The `kind` message in `data` (JSON text, or its parsed object) read from `where` (a path or URI, for the
    error)."""
    try:
        return kind.model_validate(data) if isinstance(data, dict) else kind.model_validate_json(data)
    except ValidationError as exc:
        fields = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(the whole message)'}: {e['msg']}" for e in exc.errors())
        raise MessageError(f"{where} does not hold a {kind.__name__}: {fields}") from exc


# ---------------------------------------------------------------- results (the runner → the flow side)


class TrainResult(ChunkResult):
    """What a train job returns: the chunk's result (vime_engine.chunk.run_chunk), where this attempt started and
    the machine's speed beside the chunk's step times."""

    model_config = MESSAGE_CONFIG
    resumed_from: int | None  # the newest checkpoint under --save when the attempt started (None: fresh)
    reference_seconds: float  # tasks.engine_job.speed_probe.reference_seconds, timed before training


class EvaluateResult(Message):
    """What an evaluate job returns: the eval sets' metrics on the loaded weights (none without eval sets)."""

    eval_metrics: dict[str, float]


class EngineError(Message):
    """How a job failed: its kind sets the runner's exit code and the task's retry decision."""

    kind: ErrorKind
    message: str
    traceback: str | None = None  # for a code error: the whole traceback


R = TypeVar("R", TrainResult, EvaluateResult)


class JobReport(Message, Generic[R]):
    """result.json: the job's value or its error, and the engine's own time (start-up included)."""

    engine_seconds: float
    value: R | None = None
    error: EngineError | None = None

    @model_validator(mode="after")
    def _one_outcome(self) -> JobReport:
        if (self.value is None) == (self.error is None):
            raise ValueError("a job report holds either a value or an error")
        return self


# ---------------------------------------------------------------- jobs (the flow side → the runner)


class TrainJob(Message):
    """Train rollouts start … start+count-1 (run_chunk) under the full engine flags."""

    result_type: ClassVar[type[TrainResult]] = TrainResult
    mode: Literal["train"] = "train"
    flags: dict[str, Any]
    start: int = Field(ge=0)
    count: int = Field(ge=1)


class EvaluateJob(Message):
    """Evaluate (and export, with --save-hf) the checkpoint its flags name with --load, training nothing
    (vime_engine.chunk.evaluate_checkpoint)."""

    result_type: ClassVar[type[EvaluateResult]] = EvaluateResult
    mode: Literal["evaluate"] = "evaluate"
    flags: dict[str, Any]


Job = TrainJob | EvaluateJob


class _JobFile(RootModel[Annotated[Job, Field(discriminator="mode")]]):
    """job.json: either job, told apart by its `mode` (each checks its fields by its own config)."""


def write_job(job_dir: Path, job: Job) -> Path:
    """job.json in `job_dir`, for the runner; its path."""
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / JOB_FILE
    path.write_text(job.model_dump_json(indent=1))
    return path


def read_job(path: Path) -> Job:
    return decode(_JobFile, path.read_bytes(), str(path)).root


def write_report(path: Path, report: JobReport) -> None:
    """result.json, replaced whole: a reader never sees half a report."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(report.model_dump_json())
    tmp.replace(path)


def read_report(job_dir: Path, job: Job) -> JobReport | None:
    """The runner's report on `job` (its value of the job's result type), None when it wrote none (it never
    started, e.g. Python could not import it)."""
    path = job_dir / RESULT_FILE
    if not path.is_file():
        return None
    return decode(JobReport[job.result_type], path.read_bytes(), str(path))


# ---------------------------------------------------------------- ModelArts (the submitter ↔ the job's head)


class ChunkSpec(Message):
    """What one ModelArts job trains: rollouts start … start+count-1 of `job`, with the run at `storage_root`."""

    storage_root: str
    run_name: str
    work_dir: str  # the run's local directory: model, data, checkpoints (the same path on every machine)
    start: int = Field(ge=0)
    count: int = Field(ge=1)
    job: EngineJob

    @property
    def run_prefix(self) -> str:
        return run_prefix(self.run_name)

    @property
    def spec_key(self) -> str:
        return join_key(self.run_prefix, "modelarts", f"chunk-{self.start:07d}.json")

    @property
    def result_key(self) -> str:
        return join_key(self.run_prefix, "modelarts", f"chunk-{self.start:07d}-result.json")


class CommittedChunk(TrainResult):
    """The head's result object: the engine's TrainResult (resumed_from: the checkpoint restored from OBS), its
    time, and where its end checkpoint is committed."""

    engine_seconds: float
    checkpoint_uri: str
    storage_manifest_sha256: str
