"""The trackers' shared resume rule, the run key, names and flags (no tracker store involved)."""

from __future__ import annotations

import pytest

from vime_engine.config import ConfigError, build_config
from vime_engine.tracking.resume import RUN_KEY_FILE, HeldSteps, run_key
from vime_engine.tracking.mlflow_tracker import mlflow_name
from vime_engine.tracking.wandb_log import read_records
from vime_engine.tracking.wandb_tracker import held_in_rows, held_in_summary

REQUIRED = {"hf-checkpoint": "model", "prompt-data": "data.jsonl"}


def test_held_steps_pass_on_only_metrics_past_what_the_run_holds():
    held = HeldSteps({"rollout/raw_reward": 5, "eval/aime": 3})
    assert held.new(4, {"rollout/raw_reward": 0.4, "eval/aime": 0.2}) == {"eval/aime": 0.2}
    assert held.new(4, {"eval/aime": 0.3}) == {}  # now held at 4: a second send at 4 is a duplicate
    assert held.new(6, {"rollout/raw_reward": 0.6, "train/lr": 1e-6}) == {"rollout/raw_reward": 0.6, "train/lr": 1e-6}
    assert held.new(-1, {"eval/gsm8k": 0.1}) == {"eval/gsm8k": 0.1}  # the baseline before training


def test_what_wandb_rows_and_a_resumed_summary_hold():
    rows = [{"_step": 0, "rollout_id": -1, "eval/aime": 0.1}, {"_step": 1, "rollout_id": 0, "rollout/raw_reward": 0.2},
            {"_step": 2, "rollout_id": 1, "rollout/raw_reward": 0.3}, {"_step": 3, "system.cpu": 9.0}]
    assert held_in_rows(rows) == {"eval/aime": -1, "rollout/raw_reward": 1}
    summary = {"rollout_id": 7, "rollout/raw_reward": 0.5, "eval/aime": 0.2, "_step": 12, "_runtime": 40.0}
    assert held_in_summary(summary) == {"rollout/raw_reward": 7, "eval/aime": 7}
    assert held_in_summary({"_step": 3}) == {}  # a run that logged nothing of ours


def test_the_run_key_lives_in_the_save_directory(tmp_path):
    key = run_key(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / RUN_KEY_FILE).read_text() == key
    assert run_key(str(tmp_path / "ckpt")) == key  # a resumed run finds it again
    assert run_key(str(tmp_path / "other")) != key
    assert run_key(None) != run_key(None)  # nothing to resume without --save


def test_mlflow_names_keep_vime_names_where_mlflow_allows():
    assert mlflow_name("rollout/response_len/mean") == "rollout/response_len/mean"
    assert mlflow_name("eval/aime-pass@16") == "eval/aime-pass_at_16"
    assert mlflow_name("eval/my set: a+b") == "eval/my set: a_b"


@pytest.mark.parametrize("flags, message", [
    ({"wandb-project": "p", "wandb-mode": "offline"},
     "--wandb-project, --wandb-mode take effect only with --use-wandb"),
    ({"mlflow-tracking-uri": "sqlite:///x.db"}, "--mlflow-tracking-uri take effect only with --use-mlflow"),
    ({"use-mlflow": True, "mlflow-run-id": "abc", "mlflow-experiment-name": "e"}, "give one of them"),
    ({"use-wandb": True, "wandb-mode": "dryrun"}, "--wandb-mode"),
])
def test_tracker_flags_without_their_tracker_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        build_config([], **REQUIRED, **flags)


def test_tracker_flags_parse_from_the_command_line():
    cfg = build_config(["--use-wandb", "--wandb-mode", "offline", "--wandb-run-id", "r1", "--use-mlflow",
                        "--mlflow-experiment-name", "grpo"], **REQUIRED)
    lg = cfg.logging
    assert (lg.use_wandb, lg.wandb_mode, lg.wandb_run_id, lg.use_mlflow, lg.mlflow_experiment_name) == (
        True, "offline", "r1", True, "grpo")
    assert cfg.math_hash() == build_config([], **REQUIRED).math_hash()  # tracking never changes the math


def test_a_file_that_is_not_a_wandb_log_is_named(tmp_path):
    path = tmp_path / "run-x.wandb"
    path.write_bytes(b"PK\x03\x04 not a log")
    with pytest.raises(ValueError, match="run-x.wandb is not a W&B transaction log"):
        list(read_records(path))
