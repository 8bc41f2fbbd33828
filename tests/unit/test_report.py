"""The published report says only true things: readable quantities, every dataset named as what it is, the
final evaluation taken from the run's last chunk (the engine evaluated there; nothing evaluates twice), and
regression-gate numbers kept out of it."""

from __future__ import annotations

import pytest

from tasks.evaluate import EvalOutcome, final_eval_metrics
from tasks.publish import gate_metrics, render_report, summarize
from tasks.engine_job.layout import DatasetRef, EngineJob, RunLayout
from tasks.train_chunk import ChunkOutcome
from vime_engine.data import BUILTIN_DATASETS

FLAGS = {"rm-type": "gsm8k", "n-samples-per-eval-prompt": 4}
EVAL_SETS = [{"name": "held-out", "source": "builtin://arithmetic-demo-eval", "file": None},
             {"name": "aime", "source": "builtin://aime-synthetic", "file": None}]
HISTORY = [
    {"rollout_id": -1, "eval/held-out": 0.30, "eval/held-out-pass@4": 0.6, "eval/held-out-pass@1": 0.30,
     "eval/aime": 0.0, "eval/aime-pass@1": 0.0, "eval/aime-pass@4": 0.0, "eval/held-out/response_len/mean": 9.0},
    {"rollout_id": 0, "rollout/raw_reward": 0.16, "train/train_rollout_logprob_abs_diff": 2e-3,
     "perf/train_time": 20.0},
    {"rollout_id": 1, "rollout/raw_reward": 0.75, "train/train_rollout_logprob_abs_diff": 1e-3,
     "perf/train_time": 30.0, "eval/held-out": 0.77, "eval/held-out-pass@1": 0.77, "eval/held-out-pass@4": 0.9,
     "eval/aime": 0.0, "eval/aime-pass@1": 0.0, "eval/aime-pass@4": 0.0},
]


def _job(eval_names=("held-out", "aime")) -> EngineJob:
    return EngineJob(flags=FLAGS, num_rollouts=2, model_uri="file:///m", model_manifest_hash="m" * 64,
                     train_data=DatasetRef("train", "file:///d", "d" * 64, None),
                     eval_data=[DatasetRef(n, f"file:///{n}", "e" * 64, None) for n in eval_names])


def _chunk(metrics: dict, reference: float | None = 0.01) -> ChunkOutcome:
    return ChunkOutcome(checkpoint_uri="file:///s/runs/r/checkpoints/rollout_0000001", first_rollout=0,
                        last_rollout=1, manifest_sha256="c" * 64, config_hash="h", metrics=metrics,
                        resumed_from=None, engine_seconds=1.0, wall_seconds=1.0, reference_seconds=reference)


def _lineage() -> dict:
    return {"chunks": [{"rollouts": [0, 1], "checkpoint": "file:///s/runs/r/checkpoints/rollout_0000001",
                        "manifest_sha256": "c" * 64, "resumed_from": None}],
            "model": {"source": "builtin://smollm2-135m-instruct", "revision": None, "manifest_sha256": "m" * 64},
            "datasets": [], "image": None, "config": {"identity_hash": "i" * 64},
            "versions": {"python": "3.11"},
            "parameters": {"data": {"source": "builtin://arithmetic-demo"}, "evaluation": {"datasets": EVAL_SETS}}}


def _report() -> tuple[dict, str]:
    metrics = final_eval_metrics(_job(), _chunk(HISTORY[-1]))
    summary = summarize(HISTORY, EvalOutcome("file:///c", 1, metrics, "file:///o", 1.0))
    return summary, render_report(_job(), RunLayout("file:///s", "r", "/w"), summary, _lineage(), [], "file:///p")


def test_the_final_evaluation_is_the_one_the_last_chunk_ran():
    metrics = final_eval_metrics(_job(), _chunk(HISTORY[-1]))
    assert metrics == {k: v for k, v in HISTORY[-1].items() if k.startswith("eval/")}
    with pytest.raises(ValueError, match="no final evaluation of aime.*another storage.run_name"):
        final_eval_metrics(_job(), _chunk({"eval/held-out": 0.5}))


def test_report_names_every_dataset_and_shows_before_and_final_scores():
    summary, report = _report()
    assert summary["eval/held-out before"] == 0.30 and summary["eval/held-out final"] == 0.77
    assert f"`builtin://arithmetic-demo`: {BUILTIN_DATASETS['arithmetic-demo']}" in report  # the training data
    assert f"- `held-out`: `builtin://arithmetic-demo-eval`: {BUILTIN_DATASETS['arithmetic-demo-eval']}" in report
    assert f"- `aime`: `builtin://aime-synthetic`: {BUILTIN_DATASETS['aime-synthetic']}" in report
    assert "| held-out | avg@4 | 0.3 | 0.77 |" in report and "| aime | avg@4 | 0 | 0 |" in report
    rows = [line for line in report.splitlines() if line.startswith("| held-out |")]
    assert [r.split(" | ")[1] for r in rows] == ["avg@4", "pass@1", "pass@4"]  # no lengths; pass@k by k
    assert "scores near 0" in report and "graded by `gsm8k`" in report


def test_gate_numbers_stay_out_of_the_report():
    summary, report = _report()
    assert "step_time_ratio" not in summary and "ratio" not in report
    assert "| step time | 25 s |" in report
    assert gate_metrics(HISTORY, [_chunk({}, reference=0.01)]) == {"step_time_ratio": pytest.approx(2500.0)}
    assert gate_metrics(HISTORY, [_chunk({}, reference=None)]) == {"step_time_ratio": None}
