"""Run a command as a ModelArts v2 training job on a custom image, and follow it to its end.

``submit_modelarts_job(spec, client)`` creates the job (``huaweicloudsdkmodelarts``: POST
``/v2/{project_id}/training-jobs``); ``poll_until_done`` polls ``status.phase`` with backoff, streams each
task's log preview into a logger without repeating lines (``tasks/modelarts/logs.py``), and maps the final
phase to a ``JobOutcome``; ``stop_job`` terminates it; ``run_modelarts_job`` does all three and stops the
job when the caller is interrupted (a cancelled Prefect run). Credentials come from the environment
(``HUAWEICLOUD_SDK_AK`` / ``_SK`` / ``_PROJECT_ID``, the SDK's own names) or a Prefect Secret block, and are
redacted from every message this module produces. No Prefect import at module level: the pipeline wraps.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, Field, SecretStr, field_validator

from tasks.modelarts.logs import LogTail
from tasks.storage.errors import redact

log = logging.getLogger("vimeflow.modelarts")

ENV_AK, ENV_SK, ENV_PROJECT_ID = "HUAWEICLOUD_SDK_AK", "HUAWEICLOUD_SDK_SK", "HUAWEICLOUD_SDK_PROJECT_ID"


# ---------------------------------------------------------------- credentials and client


class ModelArtsCredentials(BaseModel):
    ak: SecretStr
    sk: SecretStr
    project_id: str

    def secrets(self) -> tuple[str, str]:
        return self.ak.get_secret_value(), self.sk.get_secret_value()


def load_credentials(secret_block: str | None = None) -> ModelArtsCredentials:
    """From the Prefect Secret block ``secret_block`` (JSON ``{"ak", "sk", "project_id"}``) when named,
    else from the environment. Prefect is imported only in the first case."""
    if secret_block:
        from prefect.blocks.system import Secret

        try:
            value = Secret.load(secret_block).get()
        except ValueError as exc:  # Prefect's "Unable to find block document named …"
            raise ModelArtsError("load credentials", f"no Secret block named {secret_block!r}: save one holding "
                                 '{"ak": …, "sk": …, "project_id": …} (Prefect UI: Blocks → Secret)') from exc
        data = json.loads(value) if isinstance(value, str) else dict(value)
        missing = {"ak", "sk", "project_id"} - data.keys()
        if missing:
            raise ModelArtsError("load credentials", f"Secret block {secret_block!r} lacks {sorted(missing)}")
        return ModelArtsCredentials(ak=data["ak"], sk=data["sk"], project_id=data["project_id"])
    missing = [name for name in (ENV_AK, ENV_SK, ENV_PROJECT_ID) if not os.environ.get(name)]
    if missing:
        raise ModelArtsError("load credentials", f"environment variables not set: {', '.join(missing)}")
    return ModelArtsCredentials(ak=os.environ[ENV_AK], sk=os.environ[ENV_SK], project_id=os.environ[ENV_PROJECT_ID])


def make_client(credentials: ModelArtsCredentials, *, endpoint: str | None = None, region: str | None = None):
    """A ``ModelArtsClient``. With ``project_id`` set the SDK signs requests itself and never calls IAM."""
    from huaweicloudsdkcore.auth.credentials import BasicCredentials
    from huaweicloudsdkmodelarts.v1 import ModelArtsClient
    from huaweicloudsdkmodelarts.v1.region.modelarts_region import ModelArtsRegion

    ak, sk = credentials.secrets()
    builder = ModelArtsClient.new_builder().with_credentials(BasicCredentials(ak, sk, credentials.project_id))
    if endpoint:
        builder = builder.with_endpoints([endpoint])
    elif region:
        builder = builder.with_region(ModelArtsRegion.value_of(region))
    else:
        raise ValueError("make_client needs an endpoint or a region")
    client = builder.build()
    client.vimeflow_secrets = credentials.secrets()  # what redact() must keep out of messages
    return client


class ModelArtsError(Exception):
    """A failed ModelArts call: the operation, HTTP status and the service's error_code / error_msg."""

    def __init__(self, op: str, message: str, *, status: int | None = None, code: str | None = None,
                 secrets: tuple[str, ...] = ()):
        self.op, self.status, self.code = op, status, code
        self.message = redact(message, secrets)
        detail = ", ".join(x for x in (f"HTTP {status}" if status else "", code or "") if x)
        super().__init__(f"ModelArts {op} failed" + (f" ({detail})" if detail else "") + f": {self.message}")

    @property
    def transient(self) -> bool:
        return self.status is None or self.status >= 500 or self.status == 429


def _call(client, op: str, method: str, request):
    """Call ``client.<method>(request)``, turning SDK exceptions into ``ModelArtsError`` without secrets."""
    from huaweicloudsdkcore.exceptions import exceptions as sdk

    secrets = getattr(client, "vimeflow_secrets", ())
    try:
        return getattr(client, method)(request)
    except sdk.ServiceResponseException as exc:
        raise ModelArtsError(op, str(exc.error_msg or ""), status=exc.status_code, code=exc.error_code,
                             secrets=secrets) from None
    except sdk.SdkException as exc:  # connection, timeout, SSL
        raise ModelArtsError(op, f"{type(exc).__name__}: {exc}", secrets=secrets) from None


# ---------------------------------------------------------------- job spec


class ObsMount(BaseModel):
    """An OBS prefix given to (input) or collected from (output) the container at ``local_dir``."""

    name: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
    obs_url: str = Field(pattern=r"^obs://[^/]+/.*$")
    local_dir: str

    def api_obs_url(self) -> str:
        return api_obs_url(self.obs_url)


def api_obs_url(obs_url: str) -> str:
    """The API writes OBS paths as ``/bucket/path/`` (no scheme, trailing slash)."""
    return "/" + obs_url[len("obs://"):].rstrip("/") + "/"


class ModelArtsJobSpec(BaseModel):
    """One training job: a custom image running ``command`` on ``node_count`` nodes of ``flavor``."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    image: str
    command: str
    flavor: str
    node_count: int = Field(default=1, ge=1)
    pool_id: str | None = None
    inputs: list[ObsMount] = Field(default_factory=list)
    outputs: list[ObsMount] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    working_dir: str | None = None
    log_obs_url: str | None = Field(default=None, pattern=r"^obs://[^/]+/.*$")
    description: str = ""
    workspace_id: str | None = None

    @field_validator("env")
    @classmethod
    def _no_reserved_names(cls, env: dict[str, str]) -> dict[str, str]:
        reserved = sorted(k for k in env if k.startswith("MA_"))
        if reserved:  # ModelArts sets MA_* itself; overriding them breaks the job in odd ways
            raise ValueError(f"environment names starting with MA_ are reserved by ModelArts: {reserved}")
        return env

    def to_request_body(self) -> dict:
        """The v2 ``Job`` JSON: ``kind``, ``metadata``, ``algorithm`` (image, command, I/O, env), ``spec``."""
        algorithm = {"command": self.command, "engine": {"image_url": self.image},
                     "inputs": [{"name": m.name, "local_dir": m.local_dir,
                                 "remote": {"obs": {"obs_url": m.api_obs_url()}}} for m in self.inputs],
                     "outputs": [{"name": m.name, "local_dir": m.local_dir,
                                  "remote": {"obs": {"obs_url": m.api_obs_url()}}} for m in self.outputs],
                     "environments": dict(self.env)}
        if self.working_dir:
            algorithm["working_dir"] = self.working_dir
        resource = {"flavor_id": self.flavor, "node_count": self.node_count}
        if self.pool_id:
            resource["pool_id"] = self.pool_id
        spec: dict = {"resource": resource}
        if self.log_obs_url:
            spec["log_export_path"] = {"obs_url": api_obs_url(self.log_obs_url)}
        metadata = {"name": self.name, "description": self.description}
        if self.workspace_id:
            metadata["workspace_id"] = self.workspace_id
        return {"kind": "job", "metadata": metadata, "algorithm": algorithm, "spec": spec}


# ---------------------------------------------------------------- outcome


class JobOutcome(str, enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    CRASHED = "crashed"  # the platform lost the job: retry from the latest checkpoint
    CANCELLED = "cancelled"

    @property
    def retryable(self) -> bool:
        return self is JobOutcome.CRASHED


_TERMINAL = {"Completed": JobOutcome.COMPLETED, "Failed": JobOutcome.FAILED, "Abnormal": JobOutcome.CRASHED,
             "Terminated": JobOutcome.CANCELLED}
_CRASH_SECONDARY = {"Lost", "Unknown"}


def outcome_for(phase: str | None, secondary_phase: str | None = None) -> JobOutcome | None:
    """The outcome of a finished job, or None while it is still on its way (Creating, Pending, Running,
    Terminating). Abnormal, and a secondary phase of Lost or Unknown, mean the platform lost the job."""
    if phase in ("Lost", "Unknown") or secondary_phase in _CRASH_SECONDARY:
        return JobOutcome.CRASHED
    return _TERMINAL.get(phase or "")


@dataclass(frozen=True)
class JobResult:
    job_id: str
    outcome: JobOutcome
    phase: str
    secondary_phase: str | None
    duration_ms: int | None


# ---------------------------------------------------------------- operations


def submit_modelarts_job(spec: ModelArtsJobSpec, client) -> str:
    """Create the training job; returns its id. (The SDK serializes a plain dict body as it is.)"""
    from huaweicloudsdkmodelarts.v1 import CreateTrainingJobRequest

    request = CreateTrainingJobRequest(body=spec.to_request_body())
    response = _call(client, "create training job", "create_training_job", request)
    job_id = response.metadata.id
    log.info("ModelArts job %s created: %s on %d x %s", job_id, spec.name, spec.node_count, spec.flavor)
    return job_id


def show_job(client, job_id: str):
    from huaweicloudsdkmodelarts.v1 import ShowTrainingJobDetailsRequest

    return _call(client, "show training job", "show_training_job_details",
                 ShowTrainingJobDetailsRequest(training_job_id=job_id))


def stop_job(client, job_id: str) -> None:
    """Ask ModelArts to terminate the job (it goes Terminating → Terminated)."""
    from huaweicloudsdkmodelarts.v1 import JobActionType, StopTrainingJobRequest

    _call(client, "stop training job", "stop_training_job",
          StopTrainingJobRequest(training_job_id=job_id, body=JobActionType(action_type="terminate")))
    log.info("ModelArts job %s: terminate requested", job_id)


def fetch_log_preview(client, job_id: str, task: str) -> tuple[str, int, int]:
    """(content, current_size, full_size) of one task's log preview; the content is the log's tail."""
    from huaweicloudsdkmodelarts.v1 import ShowTrainingJobLogsPreviewRequest

    r = _call(client, "show log preview", "show_training_job_logs_preview",
              ShowTrainingJobLogsPreviewRequest(training_job_id=job_id, task_id=task))
    return r.content or "", r.current_size or 0, r.full_size or 0


def poll_until_done(client, job_id: str, *, logger: logging.Logger | logging.LoggerAdapter | None = None,
                    interval: float = 5.0, max_interval: float = 60.0, backoff: float = 1.5,
                    timeout: float | None = None, max_transient_errors: int = 5,
                    sleep: Callable[[float], None] = time.sleep) -> JobResult:
    """Poll until the job reaches a terminal phase; stream new log lines to ``logger`` on the way.

    The wait grows by ``backoff`` (up to ``max_interval``) while nothing changes, and drops back to
    ``interval`` when the phase moves or new log lines arrive. Transient API failures (5xx, 429, network)
    are retried up to ``max_transient_errors`` in a row; others raise ``ModelArtsError``. Raises
    ``TimeoutError`` after ``timeout`` seconds (the job is left running: the caller decides).
    """
    logger = logger or log
    tails: dict[str, LogTail] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    wait, errors, last_phase, secondary = interval, 0, None, None
    while True:
        try:
            job = show_job(client, job_id)
            phase, secondary = job.status.phase, job.status.secondary_phase
            tasks = list(job.status.tasks or []) or [f"worker-{i}" for i in range(_node_count(job))]
            outcome = outcome_for(phase, secondary)
            new_lines = 0
            if phase not in ("Creating", "Pending"):
                for task in tasks:
                    tail = tails.setdefault(task, LogTail())
                    lines = tail.feed(*fetch_log_preview(client, job_id, task), final=outcome is not None)
                    for line in lines:
                        logger.info("[%s] %s", task, line)
                    new_lines += len(lines)
            errors = 0
        except ModelArtsError as exc:
            if not exc.transient or errors >= max_transient_errors:
                raise
            errors += 1
            logger.warning("ModelArts job %s: %s (retry %d/%d)", job_id, exc, errors, max_transient_errors)
            phase, outcome, new_lines = last_phase, None, 0
        if phase != last_phase:
            detail = f" ({secondary})" if secondary and secondary != phase else ""
            logger.info("ModelArts job %s: phase %s%s", job_id, phase, detail)
        if outcome is not None:
            return JobResult(job_id, outcome, phase, secondary, job.status.duration)
        wait = interval if (phase != last_phase or new_lines) else min(wait * backoff, max_interval)
        last_phase = phase
        if deadline is not None and time.monotonic() + wait > deadline:
            raise TimeoutError(f"ModelArts job {job_id} still {phase} after {timeout}s")
        sleep(wait)


def _node_count(job) -> int:
    resource = getattr(getattr(job, "spec", None), "resource", None)
    return getattr(resource, "node_count", None) or 1


def run_modelarts_job(spec: ModelArtsJobSpec, client, **poll_kwargs) -> JobResult:
    """Submit, follow to the end, and terminate the job if this process is interrupted or cancelled
    while following it (KeyboardInterrupt, a cancelled task, Prefect's termination signal)."""
    job_id = submit_modelarts_job(spec, client)
    try:
        return poll_until_done(client, job_id, **poll_kwargs)
    except BaseException:
        try:
            stop_job(client, job_id)
        except ModelArtsError as exc:
            log.error("ModelArts job %s: could not terminate after interruption: %s", job_id, exc)
        raise
