"""The whole RL loop on Ray with real vLLM and the torch trainer: colocated, disaggregated, async.

In synchronous modes every rollout is generated right after a weight sync, so the trainer's log-probs of the
sampled tokens must equal vLLM's (fp32): `train/train_rollout_logprob_abs_diff` is that gap. In async mode
rollout i+1 is generated under the weights before training on rollout i, so the gap is real there; the check
is that the loop runs, overlaps, and keeps its versions straight.
"""

from __future__ import annotations

import json

import pytest

from vime_engine.config import build_config
from vime_engine.data.synthetic import materialize_builtin_dataset
from vime_engine.models.builtin import materialize_builtin_model
from vime_engine.runtime.cluster import ray_cluster
from vime_engine.runtime.driver import train

NUM_ROLLOUT = 3


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-loop")
    return (materialize_builtin_model("tiny-qwen3", root / "tiny"),
            materialize_builtin_dataset("arithmetic", root / "data"), root)


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(num_cpus=4):
        yield


def _run(inputs, name: str, **flags):
    model, data, root = inputs
    cfg = build_config([], **{
        "hf-checkpoint": str(model), "prompt-data": str(data), "input-key": "question", "label-key": "answer",
        "apply-chat-template": True, "rollout-shuffle": True, "num-rollout": NUM_ROLLOUT,
        "rollout-batch-size": 4, "n-samples-per-prompt": 4, "rollout-max-response-len": 12,
        "global-batch-size": 8, "lr": 1e-2, "vllm-kv-cache-gb": 0.25,
        "custom-rm-path": "tests/support/tiny_task.py:digit_share", "output-dir": str(root / name), **flags,
    })
    return train(cfg), root / name / "metrics.jsonl"


PLACEMENTS = {
    "colocated": {"colocate": True},
    "disaggregated": {},
    "disaggregated-broadcast": {"weight-sync": "broadcast"},
}


@pytest.mark.parametrize("name", PLACEMENTS)
def test_synchronous_loop_trains_on_exactly_the_rollout_policy(inputs, cluster, name):
    result, metrics_path = _run(inputs, name, **PLACEMENTS[name])
    assert result.rollouts_done == list(range(NUM_ROLLOUT))
    for row in result.history:
        assert row["train/train_rollout_logprob_abs_diff"] <= 1e-5, row
        assert row["weight_version"] == row["rollout_id"] + 1
        assert row["train/grad_norm"] > 0  # the optimizer moved the weights, so each sync carried news
    logged = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert len(logged) == NUM_ROLLOUT


def test_async_loop_runs_one_step_off_policy(inputs, cluster):
    result, _ = _run(inputs, "async", **{"async-rollout": True})
    assert result.rollouts_done == list(range(NUM_ROLLOUT))
    gaps = [row["train/train_rollout_logprob_abs_diff"] for row in result.history]
    assert gaps[0] <= 1e-5  # rollout 0 was generated from the synced initial weights
    assert all(gap > 1e-5 for gap in gaps[1:])  # later rollouts overlapped training: one version stale
