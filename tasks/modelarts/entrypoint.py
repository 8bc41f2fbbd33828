"""`vimeflow modelarts-entrypoint`: one training chunk inside a ModelArts training-job container.

The submitter (tasks/submit_modelarts.py) writes a `ChunkSpec` (tasks/engine_job/messages.py) to the run's OBS
prefix and creates a job whose command is `vimeflow modelarts-entrypoint --spec obs://…/modelarts/chunk-NNNNNNN.json`.
Every task (node) of the job runs that command with ModelArts' environment (`VC_TASK_INDEX`, `VC_WORKER_HOSTS`,
`MA_NUM_HOSTS`):

  task 0 (head)   fetch model and data (sha256-verified), replace the local checkpoint directory by the newest
                  checkpoint committed to OBS, start the Ray head when the job has several nodes, run the chunk
                  (`tasks.engine_job.runner` → `run_chunk`) in a child process, commit each checkpoint to OBS as
                  soon as the engine writes it (manifest last), write the chunk's result object (a
                  `CommittedChunk`), exit.
  task i > 0      join the head's Ray cluster and stay until the chunk's result is in OBS (exit 0) or the head
                  goes away without it (EXIT_INFRASTRUCTURE).

OBS is the only state that outlives a container: a job lost mid-way (ModelArts reports Abnormal) is replaced by a
new job that resumes from the newest committed checkpoint, which holds everything the engine needs to continue
bit-identically (weights, optimizer, RNG, data cursor). The run's local directory (`ChunkSpec.work_dir`) is the
same path in every container and where the flow evaluates, because the engine loads a checkpoint only under the
same --hf-checkpoint and --prompt-data paths it was trained with.

Exit codes (what the submitter reads from task 0's `exit_code`): 0 done; 75 preempted after a committed
checkpoint; 3 infrastructure (Ray, storage 5xx): retry; 2 configuration and 1 code errors: fail.
No Prefect here.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tasks.engine_job.checkpoint_history import fetch_history, upload_history
from tasks.engine_job.layout import RunLayout, localize
from tasks.engine_job.messages import (
    ChunkSpec, CommittedChunk, EngineError, TrainJob, decode, read_report, write_job,
)
from tasks.engine_job.process import InfrastructureFailure, failure_for_exit, run_chunk_runner
from tasks.engine_job.runner import EXIT_CODE_ERROR, EXIT_INFRASTRUCTURE, EXIT_OK
from tasks.storage import Storage, dir_prefix, join_key, open_storage
from tasks.storage.errors import StorageError, TransientStorageError
from vime_engine.checkpoint import store as ckpt
from vime_engine.runtime.preemption import PREEMPTED_EXIT_CODE

# Task 0's exit codes after which a new job from the newest committed checkpoint may succeed; a container
# whose process the OOM killer took reports 128 + SIGKILL.
RETRYABLE_EXIT_CODES = frozenset({PREEMPTED_EXIT_CODE, EXIT_INFRASTRUCTURE, 128 + signal.SIGKILL})
RAY_PORT = 6379
_COMMITTED_RE = re.compile(r"(?:^|/)rollout_(\d{7})/manifest\.json$")
_CHECKPOINT_DIR_RE = re.compile(r"rollout_(\d{7})")


def say(message: str) -> None:
    """One line to the job log (ModelArts' log preview is the submitter's only window into the container)."""
    print(f"[vimeflow] {message}", flush=True)


# ---------------------------------------------------------------- the run in OBS


def checkpoint_key(run_prefix: str, rollout_id: int) -> str:
    """Where the checkpoint of `rollout_id` is committed (the same place train_chunk commits to)."""
    return join_key(run_prefix, "checkpoints", ckpt.checkpoint_dir(Path("."), rollout_id).name)


def read_uri(uri: str) -> bytes:
    parent, _, name = uri.rstrip("/").rpartition("/")
    return open_storage(parent).get_bytes(name)


# ---------------------------------------------------------------- ModelArts' environment


@dataclass(frozen=True)
class ClusterEnv:
    task_index: int
    hosts: list[str]

    @property
    def is_head(self) -> bool:
        return self.task_index == 0

    @property
    def multi_node(self) -> bool:
        return len(self.hosts) > 1

    @property
    def head_address(self) -> str:
        return f"{self.hosts[0]}:{RAY_PORT}"


def parse_cluster_env(environ: dict[str, str]) -> ClusterEnv:
    """Task index and node addresses from ModelArts' variables.

    `VC_WORKER_HOSTS` lists the nodes (comma-separated, task 0 first); without it, `MA_NUM_HOSTS` must be 1 and
    the node is `MA_CURRENT_IP` (or loopback). A mismatch between the two is refused rather than guessed.
    """
    index = int(environ.get("VC_TASK_INDEX", "0"))
    hosts = [h for h in environ.get("VC_WORKER_HOSTS", "").split(",") if h]
    num_hosts = int(environ.get("MA_NUM_HOSTS", str(len(hosts) or 1)))
    if not hosts:
        if num_hosts != 1:
            raise ValueError(f"MA_NUM_HOSTS={num_hosts} but VC_WORKER_HOSTS is not set")
        hosts = [environ.get("MA_CURRENT_IP", "127.0.0.1")]
    if len(hosts) != num_hosts or not 0 <= index < num_hosts:
        raise ValueError(f"VC_WORKER_HOSTS has {len(hosts)} hosts, MA_NUM_HOSTS={num_hosts}, VC_TASK_INDEX={index}")
    return ClusterEnv(index, hosts)


def _ray(*args: str) -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts", *args]


def start_ray_head(cluster: ClusterEnv) -> str:
    """`ray start --head` on this node; the other tasks join it. Auth: the RAY_AUTH_* variables of the job."""
    subprocess.run(_ray("start", "--head", f"--node-ip-address={cluster.hosts[0]}", f"--port={RAY_PORT}",
                        "--include-dashboard=false", "--disable-usage-stats"), check=True)
    return cluster.head_address


def join_ray_head(cluster: ClusterEnv, spec: ChunkSpec, poll_s: float = 5.0) -> int:
    """A worker node: join the head (retrying while it starts), stay until it leaves, report the chunk."""
    me = cluster.hosts[cluster.task_index]
    for _ in range(60):
        joined = subprocess.run(_ray("start", f"--address={cluster.head_address}", f"--node-ip-address={me}",
                                     "--disable-usage-stats"), check=False)
        if joined.returncode == 0:
            break
        time.sleep(poll_s)
    else:
        say(f"could not join the Ray head at {cluster.head_address}")
        return EXIT_INFRASTRUCTURE
    root = open_storage(spec.storage_root)
    while not root.exists(spec.result_key) and _head_answers(cluster):
        time.sleep(poll_s)
    subprocess.run(_ray("stop"), check=False)
    return EXIT_OK if root.exists(spec.result_key) else EXIT_INFRASTRUCTURE


def _head_answers(cluster: ClusterEnv) -> bool:
    """Whether the head's Ray answers `ray status`. Once the head is gone, `ray status` tries to reach it for
    about 40 s before it fails; the node (billed while it runs) stops waiting sooner."""
    try:
        return subprocess.run(_ray("status", f"--address={cluster.head_address}"), check=False, timeout=15,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except subprocess.TimeoutExpired:
        return False


# ---------------------------------------------------------------- checkpoints between the container and OBS


def committed_rollouts(root: Storage, run_prefix: str) -> list[int]:
    """Rollout ids whose checkpoint is committed (its storage manifest exists), ascending."""
    keys = (o.key for o in root.list(dir_prefix(join_key(run_prefix, "checkpoints"))))
    return sorted({int(m.group(1)) for k in keys if (m := _COMMITTED_RE.search(k))})


def restore_latest(root: Storage, run_prefix: str, save_dir: Path, upto: int) -> tuple[int, str] | None:
    """Make `save_dir` hold exactly the newest committed checkpoint ≤ `upto` (none: empty); its rollout id and
    storage manifest hash.

    Whatever a previous container on this disk left locally is discarded: only what reached OBS counts."""
    shutil.rmtree(save_dir, ignore_errors=True)
    save_dir.mkdir(parents=True)
    ids = [i for i in committed_rollouts(root, run_prefix) if i <= upto]
    if not ids:
        return None
    target = ckpt.checkpoint_dir(save_dir, ids[-1])
    manifest = root.fetch_tree(checkpoint_key(run_prefix, ids[-1]), target)
    fetch_history(root, checkpoint_key(run_prefix, ids[-1]), save_dir)
    (save_dir / ckpt.LATEST).write_text(target.name)
    return ids[-1], manifest.hash


class CheckpointCommitter:
    """Commits every checkpoint the engine writes under `save_dir` to OBS, oldest first, while the chunk runs.

    A `rollout_NNNNNNN` directory appears only after its manifest is complete (the engine renames a finished
    staging directory into place), so a checkpoint being written is never uploaded; rollouts can finish faster
    than an upload, so it commits every directory not yet committed rather than only the one LATEST names. A
    commit that fails is logged and tried again on the next round; `commit_pending` at the end must succeed."""

    def __init__(self, root: Storage, run_prefix: str, save_dir: Path, committed: dict[int, str],
                 poll_s: float = 0.5):
        self.root, self.run_prefix, self.save_dir, self.poll_s = root, run_prefix, save_dir, poll_s
        self.committed = dict(committed)  # rollout id → storage manifest hash
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the final commit_pending must not race the follower's
        self._thread = threading.Thread(target=self._follow, name="checkpoint-committer", daemon=True)

    def __enter__(self) -> CheckpointCommitter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.commit_pending()
            except (StorageError, ckpt.CheckpointError, OSError) as exc:
                say(f"checkpoint commit deferred: {exc}")

    def commit_pending(self) -> None:
        with self._lock:
            ids = sorted(int(m.group(1)) for p in self.save_dir.glob("rollout_*")
                         if (m := _CHECKPOINT_DIR_RE.fullmatch(p.name)))
            for rollout_id in ids:
                if rollout_id not in self.committed:
                    self._commit(ckpt.validate(ckpt.checkpoint_dir(self.save_dir, rollout_id)))

    def _commit(self, found: ckpt.CheckpointRef) -> None:
        key = checkpoint_key(self.run_prefix, found.rollout_id)
        upload_history(self.root, key, found)
        manifest = self.root.commit_tree(found.path, key, meta={
            "rollout_id": found.rollout_id, "engine_manifest_sha256": found.manifest_hash})
        self.committed[found.rollout_id] = manifest.hash
        say(f"committed rollout_{found.rollout_id:07d} to {self.root.uri(key)}")


# ---------------------------------------------------------------- the head's work


def head_exit_code(engine_code: int, error: EngineError | None) -> int:
    """The head's exit code for the engine child's (and the error its report holds): a lost engine (the raylet
    died and Ray ended it with exit 1, or a signal) becomes EXIT_INFRASTRUCTURE, which the submitter retries; the
    rest pass through."""
    if engine_code in (EXIT_OK, PREEMPTED_EXIT_CODE):
        return engine_code
    return EXIT_INFRASTRUCTURE if isinstance(failure_for_exit(engine_code, error), InfrastructureFailure) \
        else engine_code


def run_head(spec: ChunkSpec, cluster: ClusterEnv) -> int:
    root = open_storage(spec.storage_root)
    layout = RunLayout(spec.storage_root, spec.run_name, spec.work_dir)
    end = spec.start + spec.count
    say(f"chunk {spec.start}..{end - 1} of run {spec.run_name} on {len(cluster.hosts)} node(s)")
    flags = localize(spec.job, layout)  # model, data, eval sets: fetched and sha256-verified
    save_dir = Path(flags["save"])
    restored = restore_latest(root, spec.run_prefix, save_dir, upto=end - 1)
    resumed = restored[0] if restored else None
    committed = dict([restored]) if restored else {}
    say("starting from the initial model" if restored is None else
        f"resuming from committed checkpoint rollout {resumed}")
    if cluster.multi_node:
        flags["ray-address"] = start_ray_head(cluster)
    job_dir = Path(layout.work_dir) / "jobs" / f"chunk-{spec.start:07d}"
    job = TrainJob(flags=flags, start=spec.start, count=spec.count)
    job_path = write_job(job_dir, job)
    try:
        with CheckpointCommitter(root, spec.run_prefix, save_dir, committed) as committer:
            code = run_chunk_runner(job_path)
        report = read_report(job_dir, job)
        error = report.error if report is not None else None
        code = head_exit_code(code, error)
        committer.commit_pending()  # the end checkpoint, or whatever was written before the engine left
        if code == PREEMPTED_EXIT_CODE:
            say("preempted: the newest checkpoint is committed; a new job continues from it")
            return code
        if code != EXIT_OK:
            say(f"engine exit {code} ({error.kind if error else 'no report'}): "
                f"{(error.traceback or error.message) if error else 'the runner never started'}")
            return code
        value = report.value  # exit 0: the runner reported its value
        last = value.last_rollout
        done = CommittedChunk(**value.model_dump(exclude={"resumed_from"}), resumed_from=resumed,
                              engine_seconds=report.engine_seconds,
                              checkpoint_uri=root.uri(checkpoint_key(spec.run_prefix, last)),
                              storage_manifest_sha256=committer.committed[last])
        root.put_bytes(spec.result_key, done.model_dump_json().encode())
        say(f"chunk done: rollouts {spec.start}..{last} committed")
        return EXIT_OK
    except TransientStorageError as exc:
        say(f"storage unavailable: {exc}")
        return EXIT_INFRASTRUCTURE
    finally:
        if cluster.multi_node:
            subprocess.run(_ray("stop"), check=False)


def main(spec_uri: str, environ: dict[str, str] | None = None) -> int:
    """The entrypoint: read the spec and ModelArts' environment, run this task's part, return the exit code."""
    environ = dict(os.environ if environ is None else environ)
    try:
        spec = decode(ChunkSpec, read_uri(spec_uri), spec_uri)
        cluster = parse_cluster_env(environ)
    except TransientStorageError as exc:
        say(f"storage unavailable: {exc}")
        return EXIT_INFRASTRUCTURE
    except (StorageError, ValueError) as exc:  # a spec that does not parse: MessageError, naming each field
        say(f"cannot start: {type(exc).__name__}: {exc}")
        return EXIT_CODE_ERROR
    if not cluster.is_head:
        return join_ray_head(cluster, spec)
    return run_head(spec, cluster)
