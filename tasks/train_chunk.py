"""train_chunk: one resumable slice of the RL run, as a cached, retried Prefect task.

The engine runs `run_chunk` in a child process (tasks.engine_job.process) on a private local Ray cluster or the
given address. Its local checkpoint directory is stable per run, so a chunk killed midway resumes from its
last in-chunk checkpoint; the chunk's end checkpoint is committed to the storage root, and the returned
ChunkOutcome is persisted there too. Cache key = input checkpoint manifest hash + config hash + rollout
range: a re-run of the flow gets finished chunks back `Cached` and trains only what is missing.

On an object-store root (s3://, obs://) a chunk holds the run's lease (tasks/storage/lease.py) from its start to its
end, so two flow runs of one run, or two attempts of one chunk on different machines, never both write its
checkpoints: the second is refused naming the holder, or takes over once a preempted holder's lease ended. A
file:// root's chunks are kept apart by the engine's own lock on the work directory's --save.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prefect import get_run_logger, runtime, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from tasks.engine_job.checkpoint_history import fetch_history, open_checkpoint, upload_history
from tasks.engine_job.layout import EngineJob, RunLayout, localize
from tasks.engine_job.messages import TrainJob, TrainResult
from tasks.engine_job.process import is_infrastructure_failure, run_engine_job
from tasks.storage import join_key, open_storage
from tasks.storage.lease import Holder, StorageLease
from vime_engine.checkpoint import store as ckpt

# Attributes of this task's log records, beside the message, for a console that follows the run in process.
ROLLOUT_RECORD = "vimeflow_rollout"  # the metrics record of one rollout (or evaluation)
ENGINE_LOG_FILE = "vimeflow_engine_log"  # where the engine's and its workers' output goes
CHUNK_LEASE = "chunk-lease"  # under the run's prefix


@dataclass(frozen=True)
class ChunkOutcome:
    """What a chunk hands to the next one (and what Prefect persists)."""

    checkpoint_uri: str  # the committed end checkpoint in the storage root
    first_rollout: int
    last_rollout: int  # inclusive
    manifest_sha256: str  # the engine's checkpoint manifest: the next chunk's cache key starts from it
    config_hash: str
    metrics: dict[str, Any]  # the last rollout's metrics
    resumed_from: int | None  # the newest checkpoint present when this attempt started (None: fresh)
    engine_seconds: float
    wall_seconds: float
    storage_manifest_sha256: str = ""
    attempts: list[str] = field(default_factory=list)
    reference_seconds: float | None = None  # tasks.engine_job.speed_probe.reference_seconds, timed before training


def chunk_cache_key(context, parameters: dict[str, Any]) -> str:
    """sha256 of the input checkpoint's manifest hash, the run's config hash, its evaluation settings and sets
    (a chunk's result carries its evaluations), the rollout range and the run's place in storage (two runs of one
    config under different names train separately)."""
    job: EngineJob = parameters["job"]
    previous: ChunkOutcome | None = parameters["previous"]
    input_manifest = previous.manifest_sha256 if previous is not None else f"model:{job.model_manifest_hash}"
    place = f"{parameters['layout'].storage_root}/{parameters['layout'].run_prefix}"
    text = (f"{input_manifest}\n{job.identity_hash}\n{job.evaluation_hash}\n"
            f"{parameters['start']}+{parameters['count']}\n{place}")
    return "train-chunk-" + hashlib.sha256(text.encode()).hexdigest()


def _format_rollout(rollout_id: int, m: dict[str, Any]) -> str:
    if "rollout/raw_reward" not in m:
        evals = ", ".join(f"{k} {v:.3f}" for k, v in sorted(m.items()) if k.startswith("eval/") and "/" not in k[5:])
        return f"eval after rollout {rollout_id}: {evals}"
    return (f"rollout {rollout_id}: reward {m['rollout/raw_reward']:.3f} "
            f"len {m.get('rollout/response_len/mean', 0):.1f} "
            f"Δlogp {m.get('train/train_rollout_logprob_abs_diff', 0):.1e} "
            f"gen {m.get('perf/rollout_time', 0):.1f}s train {m.get('perf/train_time', 0):.1f}s")


def _ensure_input_checkpoint(save_dir: Path, previous: ChunkOutcome | None) -> None:
    """Make the previous chunk's end checkpoint available locally (another machine may have trained it)."""
    if previous is None:
        return
    found = ckpt.find_latest(save_dir, content=False)
    if found is not None and found.rollout_id >= previous.last_rollout:
        return
    target = ckpt.checkpoint_dir(save_dir, previous.last_rollout)
    storage, key = open_checkpoint(previous.checkpoint_uri)
    storage.fetch_tree(key, target)
    fetch_history(storage, key, save_dir)
    (save_dir / ckpt.LATEST).write_text(target.name)


def writer_lease(layout: RunLayout, start: int) -> StorageLease | None:
    """The run's lease for this chunk on an object-store root; None on a file:// root."""
    if urlparse(layout.storage_root).scheme.lower() not in ("s3", "obs"):
        return None
    run = f"flow run {runtime.flow_run.name!r} ({runtime.flow_run.id}), train_chunk from rollout {start}"
    return StorageLease(open_storage(layout.storage_root), join_key(layout.run_prefix, CHUNK_LEASE),
                        Holder(run=run, host=socket.gethostname(), pid=os.getpid()),
                        fix=f"wait for it to end, or give this run another storage.run_name than {layout.run_name!r}")


@task(name="train_chunk", task_run_name="train_chunk-from-{start}", persist_result=True,
      cache_key_fn=chunk_cache_key, retries=3, retry_delay_seconds=2, retry_condition_fn=is_infrastructure_failure)
def train_chunk(job: EngineJob, layout: RunLayout, start: int, count: int,
                previous: ChunkOutcome | None) -> ChunkOutcome:
    """Train rollouts start … start+count-1 from `previous` (or the initial model) and commit the end checkpoint."""
    lease = writer_lease(layout, start)
    with lease or contextlib.nullcontext():
        return _train_chunk(job, layout, start, count, previous, lease)


def _train_chunk(job: EngineJob, layout: RunLayout, start: int, count: int, previous: ChunkOutcome | None,
                 lease: StorageLease | None) -> ChunkOutcome:
    logger = get_run_logger()
    flags = localize(job, layout)
    save_dir = Path(flags["save"])
    _ensure_input_checkpoint(save_dir, previous)
    total = int(flags["num-rollout"])
    progress_id = create_progress_artifact(
        progress=100.0 * start / total, key=f"{layout.artifact_key}-training",
        description=f"rollouts done of {total}; this chunk: {start}–{start + count - 1} (run {layout.run_name})")

    def on_record(rollout_id: int, record: dict[str, Any]) -> None:
        # extra: the record itself, for a console's live view (flows/console_view.py); the UI shows the line
        logger.info(_format_rollout(rollout_id, record),
                    extra={ROLLOUT_RECORD: {**record, "rollout_id": rollout_id, "chunk_start": start}})
        if "rollout/raw_reward" in record:
            update_progress_artifact(progress_id, 100.0 * (rollout_id + 1) / total)

    log_file = Path(layout.work_dir) / "logs" / f"chunk-{start:07d}.log"
    logger.info("engine and worker logs: %s", log_file, extra={ENGINE_LOG_FILE: str(log_file)})
    run = run_engine_job(TrainJob(flags=flags, start=start, count=count),
                         Path(layout.work_dir) / "jobs" / f"chunk-{start:07d}",
                         metrics_file=Path(flags["output-dir"]) / "metrics.jsonl", on_record=on_record,
                         log_file=log_file)
    value: TrainResult = run.value
    if value.resumed_from is not None and value.resumed_from >= start:
        logger.info("resumed inside the chunk from rollout %d", value.resumed_from)
    last = value.last_rollout
    key = join_key(layout.run_prefix, "checkpoints", ckpt.checkpoint_dir(Path("."), last).name)
    root = open_storage(layout.storage_root)
    if lease is not None:
        lease.ensure_held()  # before this chunk's first write to the storage root
    upload_history(root, key, ckpt.validate(Path(value.checkpoint_path), content=False))
    manifest = root.commit_tree(Path(value.checkpoint_path), key,
                                meta={"rollout_id": last, "engine_manifest_sha256": value.manifest_sha256})
    return ChunkOutcome(
        checkpoint_uri=root.uri(key), first_rollout=start, last_rollout=last,
        manifest_sha256=value.manifest_sha256, config_hash=value.config_hash, metrics=value.metrics,
        resumed_from=value.resumed_from, engine_seconds=run.engine_seconds, wall_seconds=run.wall_seconds,
        storage_manifest_sha256=manifest.hash, reference_seconds=value.reference_seconds,
    )
