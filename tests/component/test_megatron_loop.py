"""Megatron training in the same run as vLLM: `train(cfg)` with `--train-backend megatron` on megatron-core 0.16
(the main lane's Python 3.11), tensor parallel over two Ray ranks (gloo), vLLM rollouts, weight sync through the
engine's HF mapping, a torch_dist checkpoint each rollout, and a resume from it.

Each rollout is generated right after a weight sync, so Megatron's log-probs of the sampled tokens must equal
vLLM's (fp32): `train/train_rollout_logprob_abs_diff` is that gap, after every sync, with TP=2 in the loop. The
resumed run starts from the checkpoint of rollout 0; its rollout 1 (vLLM's samples from the restored weights,
Megatron's losses on them with the restored optimizer) must be the uninterrupted run's, bit for bit.

Rank processes (and the vLLM actor: Ray's setup hook is per job) get the test-only CPU shim for megatron-core's
hard-coded CUDA calls; on CUDA and Ascend none is needed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.megatron.cpu_compat import shimmed_ray_cluster
from vime_engine.config import build_config
from vime_engine.runtime.driver import train

TP2 = {"tensor-model-parallel-size": 2, "actor-num-gpus-per-node": 2}
SAME_AFTER_RESUME = ("train/pg_loss", "train/ppo_kl", "train/entropy_loss", "rollout/raw_reward",
                     "rollout/response_len/mean")


@pytest.fixture(scope="module")
def cluster():
    with shimmed_ray_cluster():
        yield


def _run(tiny_model, data, run_dir: Path):
    cfg = build_config([], **{
        "hf-checkpoint": str(tiny_model), "prompt-data": str(data), "input-key": "question", "label-key": "answer",
        "apply-chat-template": True, "rollout-shuffle": True, "num-rollout": 2, "rollout-batch-size": 4,
        "n-samples-per-prompt": 4, "rollout-max-response-len": 12, "global-batch-size": 8, "micro-batch-size": 4,
        "lr": 1e-3, "clip-grad": 0.0,  # Megatron's gradient clipping is not usable on CPU (shared/PLATFORM.md)
        "vllm-kv-cache-gb": 0.25, "custom-rm-path": "tests/support/tiny_task.py:digit_share",
        "train-backend": "megatron", "save-interval": 1, "save": str(run_dir / "ckpt"),
        "output-dir": str(run_dir / "out"), **TP2,
    })
    return train(cfg)


def test_vllm_and_megatron_tp2_in_one_run_agree_after_every_sync_and_resume(tiny_model, arithmetic_data, cluster,
                                                                           tmp_path):
    whole = _run(tiny_model, arithmetic_data, tmp_path / "whole")
    assert whole.rollouts_done == [0, 1]
    for row in whole.history:
        print(f"rollout {row['rollout_id']}: vLLM vs Megatron log-prob gap "
              f"{row['train/train_rollout_logprob_abs_diff']:.2e}, train {row['perf/train_time']:.2f} s, "
              f"sync {row['perf/update_weights_time']:.3f} s")
        assert row["train/train_rollout_logprob_abs_diff"] <= 1e-5, row
        assert row["weight_version"] == row["rollout_id"] + 1
    assert whole.history[0]["train/pg_loss"] != whole.history[1]["train/pg_loss"]
    assert (tmp_path / "whole" / "ckpt" / "rollout_0000001").is_dir()

    resumed_ckpt = tmp_path / "resumed" / "ckpt"
    resumed_ckpt.mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "ckpt" / "rollout_0000000", resumed_ckpt / "rollout_0000000")
    resumed = _run(tiny_model, arithmetic_data, tmp_path / "resumed")
    assert resumed.rollouts_done == [1]
    row, expected = resumed.history[-1], whole.history[1]
    assert row["train/train_rollout_logprob_abs_diff"] <= 1e-5  # the engine got the restored weights first
    assert {k: row[k] for k in SAME_AFTER_RESUME} == {k: expected[k] for k in SAME_AFTER_RESUME}
