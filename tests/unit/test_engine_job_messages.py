"""The engine-process boundary's messages (tasks/engine_job/messages.py): each survives its own file, a missing,
unknown or mistyped field is refused naming the field and the file, files in the keys of the dicts they
replaced still read, and the evaluation entry trains nothing."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from tasks.engine_job.layout import DatasetRef, EngineJob
from tasks.engine_job.messages import (
    LOST, RESULT_FILE, ChunkSpec, CommittedChunk, EngineError, EvaluateJob, EvaluateResult, JobReport,
    MessageError, TrainJob, TrainResult, decode, read_job, read_report, write_job, write_report,
)
from vime_engine.chunk import evaluate_checkpoint
from vime_engine.config import ConfigError, from_flat

FLAGS = {"hf-checkpoint": "/m", "prompt-data": "/d.jsonl", "eval-prompt-data": ["aime", "/a.jsonl"]}
CHUNK = {"checkpoint_path": "/w/checkpoints/rollout_0000003", "first_rollout": 2, "last_rollout": 3,
         "manifest_sha256": "ab" * 32, "config_hash": "cd" * 32, "metrics": {"rollout_id": 3, "eval/aime": 0.25}}
TRAINED = TrainResult(**CHUNK, resumed_from=2, reference_seconds=0.012)


def _spec() -> ChunkSpec:
    job = EngineJob(flags={"lr": 1e-6}, num_rollouts=4, model_uri="obs://b/m", model_manifest_hash="11" * 32,
                    train_data=DatasetRef("train", "obs://b/d", "22" * 32, None),
                    eval_data=[DatasetRef("aime", "obs://b/a", "33" * 32, "aime.jsonl")])
    return ChunkSpec(storage_root="obs://b", run_name="r", work_dir="/cache/vimeflow", start=2, count=2, job=job)


def test_every_message_reads_back_as_written(tmp_path):
    for job in (TrainJob(flags=FLAGS, start=2, count=2), EvaluateJob(flags=FLAGS)):
        assert read_job(write_job(tmp_path / job.mode, job)) == job
    train = TrainJob(flags=FLAGS, start=2, count=2)
    write_report(tmp_path / "train" / RESULT_FILE, JobReport(engine_seconds=9.5, value=TRAINED))
    assert read_report(tmp_path / "train", train) == JobReport[TrainResult](engine_seconds=9.5, value=TRAINED)
    lost = JobReport(engine_seconds=0.0, error=EngineError(kind=LOST, message="ended without reporting"))
    write_report(tmp_path / "train" / RESULT_FILE, lost)
    assert read_report(tmp_path / "train", train).error == lost.error
    evaluated = JobReport(engine_seconds=1.0, value=EvaluateResult(eval_metrics={"eval/aime": 0.5}))
    write_report(tmp_path / "evaluate" / RESULT_FILE, evaluated)
    assert read_report(tmp_path / "evaluate", EvaluateJob(flags=FLAGS)).value == evaluated.value
    assert read_report(tmp_path / "none", train) is None  # the runner never started
    spec = _spec()
    assert decode(ChunkSpec, spec.model_dump_json(), "spec") == spec
    done = CommittedChunk(**TRAINED.model_dump(), engine_seconds=9.5, checkpoint_uri="obs://b/runs/r/c",
                          storage_manifest_sha256="44" * 32)
    assert decode(CommittedChunk, json.loads(done.model_dump_json()), "result") == done


def test_a_mistyped_missing_or_unknown_field_is_named_with_the_file(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"mode": "train", "flags": FLAGS, "start": "first", "count": 1}))
    with pytest.raises(MessageError, match=rf"{path} does not hold a .*train\.start: Input should be a valid integer"):
        read_job(path)
    path.write_text(json.dumps({"mode": "export", "flags": FLAGS}))
    with pytest.raises(MessageError, match="does not match any of the expected tags: 'train', 'evaluate'"):
        read_job(path)

    value = TRAINED.model_dump()
    del value["config_hash"]
    value["resumed_form"] = 2  # a typo
    (tmp_path / RESULT_FILE).write_text(json.dumps({"engine_seconds": 1.0, "value": value}))
    with pytest.raises(MessageError) as raised:
        read_report(tmp_path, TrainJob(flags=FLAGS, start=2, count=2))
    assert "value.config_hash: Field required" in str(raised.value)
    assert "value.resumed_form: Extra inputs are not permitted" in str(raised.value)

    with pytest.raises(MessageError, match="a job report holds either a value or an error"):
        decode(JobReport, json.dumps({"engine_seconds": 1.0}), "result.json")
    with pytest.raises(MessageError, match=r"job\.train_data\.manifest_hash: Input should be a valid string"):
        decode(ChunkSpec, _spec().model_dump_json().replace('"22' + "22" * 31 + '"', "22"), "obs://b/spec.json")


def test_files_in_the_replaced_dicts_keys_still_read(tmp_path):
    """What the runner and the ModelArts head wrote as plain dicts (json.dumps, asdict) is the same message."""
    old_result = {"value": {**CHUNK, "resumed_from": 2, "reference_seconds": 0.012}, "engine_seconds": 9.5}
    (tmp_path / RESULT_FILE).write_text(json.dumps(old_result, default=str))
    assert read_report(tmp_path, TrainJob(flags=FLAGS, start=2, count=2)).value == TRAINED
    spec = _spec()
    old_spec = {"storage_root": spec.storage_root, "run_name": spec.run_name, "work_dir": spec.work_dir,
                "start": spec.start, "count": spec.count, "job": asdict(spec.job)}
    assert decode(ChunkSpec, json.dumps(old_spec, indent=1, sort_keys=True), "spec") == spec


def test_the_evaluation_entry_refuses_a_config_that_would_train():
    with pytest.raises(ConfigError, match="--num-rollout must be 0, not 2"):
        evaluate_checkpoint(from_flat({"hf-checkpoint": "/m", "prompt-data": "/d.jsonl", "num-rollout": 2}))
