"""submit_modelarts: one training chunk as a ModelArts training job, as a cached, retried Prefect task.

The chunk's `ChunkSpec` (tasks/engine_job/messages.py) goes to `{run}/modelarts/chunk-NNNNNNN.json` in the
(obs://) storage root; the job runs `vimeflow modelarts-entrypoint --spec <that URI>`
(tasks/modelarts/entrypoint.py) on the custom image. The job's log preview streams into the task's log. Its end:

  Completed                    the entrypoint's result object (a CommittedChunk) → ChunkOutcome (as train_chunk
                               returns it)
  Abnormal / Lost / Unknown    ModelArtsJobLost: retried, as a NEW job that resumes from the newest checkpoint
                               the lost one committed
  Failed, task 0 exit 75 or 3  ModelArtsJobLost as well (preempted after a checkpoint; Ray or storage failure)
  Failed, other exit codes     ModelArtsJobFailed: not retried
  Terminated                   the task run ends Cancelled
  this run cancelled           run_modelarts_job terminates the job before the task stops

Same cache key as train_chunk (input checkpoint manifest + config + range): a re-run skips finished chunks.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import time

from prefect import get_run_logger, task
from prefect.states import Cancelled
from pydantic import BaseModel, ConfigDict, Field

from tasks.engine_job.process import InfrastructureFailure
from tasks.modelarts.client import (
    JobOutcome, JobResult, ModelArtsError, ModelArtsJobSpec, load_credentials, make_client, run_modelarts_job,
    show_job,
)
from tasks.modelarts.entrypoint import RETRYABLE_EXIT_CODES
from tasks.engine_job.layout import EngineJob, RunLayout
from tasks.engine_job.messages import ChunkSpec, CommittedChunk, decode
from tasks.storage import open_storage
from tasks.storage.errors import TransientStorageError
from tasks.train_chunk import ChunkOutcome, chunk_cache_key

# OBS settings the container needs to reach the storage root; credentials are forwarded only when listed.
DEFAULT_FORWARD_ENV = ["OBS_ENDPOINT", "OBS_SERVER", "OBS_REGION", "OBS_SIGNATURE", "OBS_PATH_STYLE"]


class ModelArtsSettings(BaseModel):
    """Where and how the training chunks run on ModelArts."""

    model_config = ConfigDict(extra="forbid")
    image: str = Field(description="the training image in SWR (docker/Dockerfile or Dockerfile.npu)")
    flavor: str = Field(description="resource flavor id, e.g. modelarts.pool.visual.xlarge")
    node_count: int = Field(1, ge=1, le=512)
    pool_id: str | None = Field(None, description="a dedicated resource pool (None: the public pool)")
    endpoint: str | None = Field(None, description="API endpoint URL (default: the region's)")
    region: str | None = Field(None, description="e.g. cn-southwest-2, when no endpoint is given")
    credentials_block: str | None = Field(None, description="Prefect Secret block with {ak, sk, project_id}; "
                                          "default: HUAWEICLOUD_SDK_AK / _SK / _PROJECT_ID")
    entrypoint: str = Field("vimeflow modelarts-entrypoint", description="the command inside the image")
    working_dir: str | None = None
    work_dir: str = Field("/cache/vimeflow", description="local directory for model, data and checkpoints: the same "
                          "path in the containers and where the flow evaluates (the engine loads a checkpoint only "
                          "under the --hf-checkpoint / --prompt-data paths it was trained with)")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables of the job")
    forward_env: list[str] = Field(default_factory=lambda: list(DEFAULT_FORWARD_ENV),
                                   description="variables copied from the flow's environment into the job "
                                   "(add OBS_ACCESS_KEY_ID / OBS_SECRET_ACCESS_KEY when no agency provides them)")
    poll_interval_s: float = Field(10.0, gt=0)
    max_poll_interval_s: float = Field(60.0, gt=0)


class ModelArtsJobLost(InfrastructureFailure):
    """The job was lost, preempted or hit an infrastructure failure: a new job can continue."""


class ModelArtsJobFailed(RuntimeError):
    """The job's command failed (configuration or code error): another job would fail the same way."""


def job_name(run_name: str, start: int) -> str:
    """`vf-<run>-c<start>-<time>`: ModelArts allows [A-Za-z0-9_-]{1,64}; unique per attempt."""
    run = re.sub(r"[^A-Za-z0-9_-]", "-", run_name)[:36]
    return f"vf-{run}-c{start}-{int(time.time() * 1000) % 10**9}"


def modelarts_client(settings: ModelArtsSettings):
    """The API client, signed with the credentials of the Secret block the settings name (else the environment)."""
    return make_client(load_credentials(settings.credentials_block), endpoint=settings.endpoint,
                       region=settings.region)


def job_spec(spec: ChunkSpec, spec_uri: str, settings: ModelArtsSettings) -> ModelArtsJobSpec:
    env = {name: os.environ[name] for name in settings.forward_env if os.environ.get(name)}
    env.update(settings.env)
    if settings.node_count > 1:  # Ray ≥ 2.5x clusters require a token; a fresh one per job
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    log_url = None
    if spec.storage_root.startswith("obs://"):
        log_url = f"{spec.storage_root.rstrip('/')}/{spec.run_prefix}/modelarts/logs"
    return ModelArtsJobSpec(
        name=job_name(spec.run_name, spec.start), image=settings.image,
        command=f"{settings.entrypoint} --spec {shlex.quote(spec_uri)}", flavor=settings.flavor,
        node_count=settings.node_count, pool_id=settings.pool_id, env=env, working_dir=settings.working_dir,
        log_obs_url=log_url,
        description=f"vimeflow run {spec.run_name}: rollouts {spec.start}..{spec.start + spec.count - 1}")


def head_exit_code(client, job_id: str) -> int | None:
    """Task 0's exit code as ModelArts reports it (None when it did not say)."""
    statuses = show_job(client, job_id).status.task_statuses or []
    codes = {s.task: s.exit_code for s in statuses}
    return codes.get("worker-0")


def outcome_of(result: JobResult, head_code: int | None) -> None:
    """Raise what the finished job means for the task; return for a Completed job."""
    if result.outcome is JobOutcome.COMPLETED:
        return
    where = f"ModelArts job {result.job_id} ended {result.phase}"
    if result.secondary_phase and result.secondary_phase != result.phase:
        where += f" ({result.secondary_phase})"
    if result.outcome is JobOutcome.CRASHED:
        raise ModelArtsJobLost(f"{where}: a new job resumes from the newest committed checkpoint")
    if result.outcome is JobOutcome.FAILED and head_code in RETRYABLE_EXIT_CODES:
        raise ModelArtsJobLost(f"{where}, exit code {head_code}: a new job resumes from the newest checkpoint")
    raise ModelArtsJobFailed(f"{where}, exit code {head_code}: see the job log above")


def is_retryable(task, task_run, state) -> bool:
    """Prefect retry condition: a lost job, a transient API or storage failure."""
    try:
        state.result()
    except (ModelArtsJobLost, TransientStorageError):
        return True
    except ModelArtsError as exc:
        return exc.transient
    except Exception:  # noqa: BLE001  (failed commands and bugs fail at once)
        return False
    return False


@task(name="submit_modelarts", task_run_name="submit_modelarts-from-{start}", persist_result=True,
      cache_key_fn=chunk_cache_key, retries=3, retry_delay_seconds=2, retry_condition_fn=is_retryable)
def submit_modelarts(job: EngineJob, layout: RunLayout, start: int, count: int, previous: ChunkOutcome | None,
                     settings: ModelArtsSettings) -> ChunkOutcome:
    """Train rollouts start … start+count-1 as a ModelArts job; the job commits the end checkpoint to OBS."""
    del previous  # the job resumes from what is committed in OBS; `previous` keys the cache
    logger = get_run_logger()
    spec = ChunkSpec(storage_root=layout.storage_root, run_name=layout.run_name, work_dir=layout.work_dir,
                     start=start, count=count, job=job)
    root = open_storage(layout.storage_root)
    root.put_bytes(spec.spec_key, spec.model_dump_json(indent=1).encode())
    client = modelarts_client(settings)
    t0 = time.perf_counter()
    result = run_modelarts_job(job_spec(spec, root.uri(spec.spec_key), settings), client, logger=logger,
                               interval=settings.poll_interval_s, max_interval=settings.max_poll_interval_s)
    if result.outcome is JobOutcome.CANCELLED:
        return Cancelled(message=f"ModelArts job {result.job_id} was terminated")
    outcome_of(result, None if result.outcome is JobOutcome.CRASHED else head_exit_code(client, result.job_id))
    done = decode(CommittedChunk, root.read_json(spec.result_key), root.uri(spec.result_key))
    logger.info("ModelArts job %s: rollouts %d..%d in %.0f s (engine %.0f s)", result.job_id, start,
                done.last_rollout, time.perf_counter() - t0, done.engine_seconds)
    return ChunkOutcome(
        checkpoint_uri=done.checkpoint_uri, first_rollout=start, last_rollout=done.last_rollout,
        manifest_sha256=done.manifest_sha256, config_hash=done.config_hash, metrics=done.metrics,
        resumed_from=done.resumed_from, engine_seconds=done.engine_seconds,
        wall_seconds=time.perf_counter() - t0, storage_manifest_sha256=done.storage_manifest_sha256,
        attempts=[result.job_id], reference_seconds=done.reference_seconds,
    )
