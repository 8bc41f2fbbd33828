"""vime's plugin file (tests/support/vime_plugins.py) through the real engine: Ray, vLLM and the torch trainer
(colocated in one actor, the quickest to start) on the tiny model, two rollouts, with vime's async reward,
dynamic filter, buffer filter (partial rollout), sample filter, all-samples process, reward post-process,
advantage function and rollout log function all set at once."""

from __future__ import annotations

import json
import os

import pytest

from vime_engine.config import build_config
from vime_engine.runtime.driver import train

PLUGINS = "tests/support/vime_plugins.py"
HOOKS = {
    "custom-rm-path": "custom_rm",
    "dynamic-sampling-filter-path": "dynamic_filter",
    "buffer-filter-path": "buffer_filter",
    "rollout-sample-filter-path": "rollout_sample_filter",
    "rollout-all-samples-process-path": "rollout_all_samples_process",
    "custom-reward-post-process-path": "reward_post_process",
    "custom-advantage-function-path": "custom_advantage",
    "custom-rollout-log-function-path": "log_rollout",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model, arithmetic_data, cluster):
    root = tmp_path_factory.mktemp("vime-plugins")
    cfg = build_config([], **{
        "hf-checkpoint": str(tiny_model), "prompt-data": str(arithmetic_data),
        "input-key": "question", "label-key": "answer", "apply-chat-template": True,
        "num-rollout": 2, "rollout-batch-size": 2, "n-samples-per-prompt": 2, "over-sampling-batch-size": 3,
        "partial-rollout": True, "rollout-max-response-len": 12, "global-batch-size": 4, "lr": 1e-2,
        "vllm-kv-cache-gb": 0.25, "colocate": True, "output-dir": str(root / "out"),
        **{flag: f"{PLUGINS}:{function}" for flag, function in HOOKS.items()},
    })
    result = train(cfg)
    notes = [json.loads(line) for line in (root / "out" / "vime_plugins.jsonl").read_text().splitlines()]
    logged = [json.loads(line) for line in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    return result, notes, logged


def _by_hook(notes, hook):
    return [n for n in notes if n["hook"] == hook]


def test_the_run_trains_with_every_hook_set(run):
    result, _, logged = run
    assert result.rollouts_done == [0, 1]
    assert len(logged) == 2  # the log function returned False: our logging went on
    for row in result.history:
        assert 0.0 <= row["rollout/raw_reward"] <= 1.0 and row["rollout/reward_std"] > 0  # the async reward's
        assert row["train/grad_norm"] > 0


def test_driver_hooks_ran_in_the_driver_once_per_rollout(run):
    result, notes, _ = run
    logs = _by_hook(notes, "log_rollout")
    assert [n["rollout_id"] for n in logs] == [0, 1] and all(n["pid"] == os.getpid() for n in logs)
    for note, row in zip(logs, result.history):
        assert note["samples"] == 4 and note["mean_reward"] == pytest.approx(row["rollout/raw_reward"])
        assert "rollout/aborted_groups" in note["extra"]
    assert [n["groups"] for n in _by_hook(notes, "rollout_sample_filter")] == [2, 2]
    assert all(n["groups"] >= 2 and n["has_data_source"] for n in _by_hook(notes, "rollout_all_samples_process"))
    # The buffer filter handed every group cut off in rollout 0 back to rollout 1.
    assert result.history[1]["rollout/resumed_groups"] == result.history[0]["rollout/aborted_groups"]


def test_trainer_hooks_ran_in_the_trainer_on_what_the_driver_hooks_left(run):
    _, notes, _ = run
    post, advantage = _by_hook(notes, "reward_post_process"), _by_hook(notes, "custom_advantage")
    assert len(post) == len(advantage) == 2 and all(n["pid"] != os.getpid() for n in post + advantage)
    for p, a in zip(post, advantage):
        assert a["rewards"] == pytest.approx(p["rewards"])  # the advantage function got the post-processed rewards
        assert sum(p["rewards"][:2]) == pytest.approx(0) and sum(p["rewards"][2:]) == pytest.approx(0)
        assert sum(a["masked_out"]) == 2  # the sample filter's removed sample per group trains no token
