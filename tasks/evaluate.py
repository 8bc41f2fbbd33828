"""evaluate: the engine's AIME-style evaluation (avg@n, pass@k, per-problem results) of one checkpoint.

The engine runs eval-only (`--num-rollout 0 --load DIR`) in a child process on the named checkpoint, fetched
from the storage root into a directory of its own, and exports the weights as an HF directory
(`--save-hf`). Both outputs are committed to `{run}/evaluation/rollout_NNNNNNN/`; the result is cached by
the checkpoint's manifest and the evaluation settings.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from tasks.engine_process import is_infrastructure_failure, run_engine_job
from tasks.run_layout import EngineJob, RunLayout, localize
from tasks.storage import join_key, open_storage
from tasks.train_chunk import ChunkOutcome
from vime_engine import checkpoint as ckpt

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


@task(name="evaluate", persist_result=True, cache_key_fn=eval_cache_key, retries=2, retry_delay_seconds=2,
      retry_condition_fn=is_infrastructure_failure)
def evaluate(job: EngineJob, layout: RunLayout, checkpoint: ChunkOutcome) -> EvalOutcome:
    """Evaluate `checkpoint` on every eval set and export its HF weights."""
    logger = get_run_logger()
    rollout_id = checkpoint.last_rollout
    work = Path(layout.work_dir) / "evaluation" / f"rollout_{rollout_id:07d}"
    load_root = work / "checkpoint"
    open_storage(checkpoint.checkpoint_uri).fetch_tree("", ckpt.checkpoint_dir(load_root, rollout_id))
    (load_root / ckpt.LATEST).write_text(ckpt.checkpoint_dir(load_root, rollout_id).name)
    out = work / "output"
    flags = localize(job, layout)
    flags.pop("save-interval", None)
    flags.update({"save": None, "load": str(load_root), "num-rollout": 0, "output-dir": str(out),
                  "save-hf": str(out / "hf")})
    run = run_engine_job({"mode": "evaluate", "flags": flags}, work / "job")
    metrics = {k: float(v) for k, v in run.value["eval_metrics"].items()}
    for name, value in sorted(metrics.items()):
        if "/" not in name[5:]:
            logger.info("%s = %.4f", name, value)
    key = join_key(layout.run_prefix, "evaluation", f"rollout_{rollout_id:07d}")
    root = open_storage(layout.storage_root)
    root.commit_tree(out, key, meta={"rollout_id": rollout_id, "metrics": metrics})
    return EvalOutcome(checkpoint.checkpoint_uri, rollout_id, metrics, root.uri(key), run.engine_seconds)
