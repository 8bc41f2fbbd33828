"""A chunk's cache key changes with its evaluations (they are part of its result), not only with the math."""

from __future__ import annotations

from dataclasses import replace

from tasks.engine_job.layout import DatasetRef, EngineJob


def _job(**flags) -> EngineJob:
    return EngineJob(
        flags={"rollout-batch-size": 4, "n-samples-per-eval-prompt": 2, **flags}, num_rollouts=4,
        model_uri="file:///m", model_manifest_hash="a" * 64,
        train_data=DatasetRef("train", "file:///d", "b" * 64, None),
        eval_data=[DatasetRef("aime", "file:///e", "c" * 64, None)],
    )


def test_evaluation_settings_and_sets_change_the_evaluation_hash_alone():
    base = _job()
    assert _job(**{"n-samples-per-eval-prompt": 4}).evaluation_hash != base.evaluation_hash
    assert _job(**{"eval-max-response-len": 64}).evaluation_hash != base.evaluation_hash
    other_set = replace(base, eval_data=[DatasetRef("aime", "file:///e", "d" * 64, None)])
    assert other_set.evaluation_hash != base.evaluation_hash
    assert other_set.identity_hash == base.identity_hash  # the weights' math is the same
    assert _job(**{"rollout-batch-size": 8}).evaluation_hash == base.evaluation_hash
