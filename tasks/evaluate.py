"""evaluate: the final evaluation of the run (avg@n, pass@k, per-problem rows) and the HF export of its last
checkpoint.

The engine evaluates the final weights itself, at the run's last rollout inside the last chunk; this task takes
those numbers from the chunk's result (and the per-problem rows from the chunk's output directory, when the
chunk ran on this machine) instead of evaluating a second time. It fetches the checkpoint from the storage root
into a directory of its own and exports its weights as an HF directory in an engine child process (an
EvaluateJob: vime_engine.chunk.evaluate_checkpoint with `--num-rollout 0 --load DIR --save-hf`, no eval sets; for
the torch trainer of one rank on CPU, the embedded default, that process writes it without starting Ray or vLLM).
Both are committed to `{run}/evaluation/rollout_NNNNNNN/`; the result is cached by the checkpoint's manifest
and the evaluation settings.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from tasks.engine_job.checkpoint_history import fetch_history, open_checkpoint
from tasks.engine_job.layout import EngineJob, RunLayout, localize
from tasks.engine_job.messages import EvaluateJob
from tasks.engine_job.process import is_infrastructure_failure, run_engine_job
from tasks.storage import join_key, open_storage
from tasks.train_chunk import ChunkOutcome
from vime_engine.checkpoint import store as ckpt

EVAL_FLAGS = ("n-samples-per-eval-prompt", "eval-input-key", "eval-label-key", "eval-rm-type",
              "eval-max-response-len", "eval-temperature", "eval-top-p")


@dataclass(frozen=True)
class EvalOutcome:
    checkpoint_uri: str
    rollout_id: int
    metrics: dict[str, float]
    output_uri: str  # committed: eval/<name>_rollout_*.jsonl (per problem), hf/ (the HF export), metrics.jsonl
    engine_seconds: float


def eval_cache_key(context, parameters: dict[str, Any]) -> str:
    job: EngineJob = parameters["job"]
    chunk: ChunkOutcome = parameters["checkpoint"]
    settings = {k: job.flags.get(k) for k in EVAL_FLAGS}
    sets = [(r.name, r.manifest_hash, r.file) for r in job.eval_data]
    text = json.dumps([chunk.manifest_sha256, settings, sets], sort_keys=True, default=str)
    return "evaluate-" + hashlib.sha256(text.encode()).hexdigest()


def final_eval_metrics(job: EngineJob, checkpoint: ChunkOutcome) -> dict[str, float]:
    """The `eval/…` metrics the engine logged at the run's last rollout (the last chunk's `metrics`); an eval set
    of the job that they lack is an error (a chunk trained under other eval sets came back from the cache)."""
    metrics = {k: float(v) for k, v in checkpoint.metrics.items() if k.startswith("eval/")}
    missing = [r.name for r in job.eval_data if f"eval/{r.name}" not in metrics]
    if missing:
        raise ValueError(f"the run's last chunk (checkpoint {checkpoint.checkpoint_uri}) holds no final evaluation "
                         f"of {', '.join(missing)}: it was trained with other eval sets and came back from the "
                         "cache; give the run another storage.run_name to train and evaluate it afresh")
    return metrics


def _copy_rows(chunk_eval_dir: Path, dest: Path, names: list[str], rollout_id: int) -> None:
    """The per-problem rows of the final evaluation, where the last chunk wrote them (absent when it ran on
    another machine, e.g. as a ModelArts job)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        rows = chunk_eval_dir / f"{name}_rollout_{rollout_id + 1:07d}.jsonl"
        if rows.is_file():
            shutil.copy2(rows, dest / rows.name)


@task(name="evaluate", persist_result=True, cache_key_fn=eval_cache_key, retries=2, retry_delay_seconds=2,
      retry_condition_fn=is_infrastructure_failure)
def evaluate(job: EngineJob, layout: RunLayout, checkpoint: ChunkOutcome) -> EvalOutcome:
    """The final evaluation of the run's last checkpoint `checkpoint` (from the chunk that trained it) and the
    checkpoint's HF export."""
    logger = get_run_logger()
    rollout_id = checkpoint.last_rollout
    metrics = final_eval_metrics(job, checkpoint)
    work = Path(layout.work_dir) / "evaluation" / f"rollout_{rollout_id:07d}"
    load_root = work / "checkpoint"
    storage, key = open_checkpoint(checkpoint.checkpoint_uri)
    storage.fetch_tree(key, ckpt.checkpoint_dir(load_root, rollout_id))
    fetch_history(storage, key, load_root)
    (load_root / ckpt.LATEST).write_text(ckpt.checkpoint_dir(load_root, rollout_id).name)
    out = work / "output"
    flags = localize(job, layout)
    _copy_rows(Path(flags["output-dir"]) / "eval", out / "eval", [r.name for r in job.eval_data], rollout_id)
    for flag in ("save-interval", "eval-prompt-data", "eval-interval", *EVAL_FLAGS):  # an export, no evaluation
        flags.pop(flag, None)
    flags.update({"save": None, "load": str(load_root), "num-rollout": 0, "output-dir": str(out),
                  "save-hf": str(out / "hf")})
    run = run_engine_job(EvaluateJob(flags=flags), work / "job",
                         log_file=Path(layout.work_dir) / "logs" / f"export-rollout_{rollout_id:07d}.log")
    for name, value in sorted(metrics.items()):
        if "/" not in name[5:]:
            logger.info("%s = %.4f", name, value)
    key = join_key(layout.run_prefix, "evaluation", f"rollout_{rollout_id:07d}")
    root = open_storage(layout.storage_root)
    root.commit_tree(out, key, meta={"rollout_id": rollout_id, "metrics": metrics})
    return EvalOutcome(checkpoint.checkpoint_uri, rollout_id, metrics, root.uri(key), run.engine_seconds)
