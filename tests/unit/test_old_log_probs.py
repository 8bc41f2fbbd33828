"""A rollout trained in one optimizer step takes its old log-probs from the training forward itself: the same
update and metrics as a separate no-grad pass first; several steps per rollout still need that pass."""

from __future__ import annotations

import random

import pytest
import torch

from vime_engine.config import build_config
from vime_engine.models.builtin import materialize_builtin_model
from vime_engine.sample import Sample
from vime_engine.train.rollout_batch import build_rollout_batch, old_log_probs_from_training_forward
from vime_engine.train.torch_backend import TorchTrainBackend


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return materialize_builtin_model("tiny-qwen3", tmp_path_factory.mktemp("tiny") / "model")


def _samples() -> list[Sample]:
    rng = random.Random(1)
    out = []
    for i in range(8):
        n = rng.randrange(2, 12)
        out.append(Sample(i // 4, "", "", [rng.randrange(10, 90) for _ in range(rng.randrange(4, 12))],
                          [rng.randrange(10, 90) for _ in range(n)], rollout_log_probs=[-2.0] * n,
                          loss_mask=[1] * n, reward=float(i % 3 == 0)))
    return out


def _config(model_dir, **flags):
    return build_config([], **{"hf-checkpoint": str(model_dir), "prompt-data": "unused", "rollout-batch-size": 2,
                               "n-samples-per-prompt": 4, "micro-batch-size": 3, "lr": 1e-3, **flags})


def test_which_rollouts_need_the_separate_pass(tiny_model_dir):
    assert old_log_probs_from_training_forward(_config(tiny_model_dir), 8)
    assert not old_log_probs_from_training_forward(_config(tiny_model_dir, **{"global-batch-size": 4}), 8)
    reinforce = {"advantage-estimator": "reinforce_plus_plus", "kl-coef": 0.1}
    assert not old_log_probs_from_training_forward(_config(tiny_model_dir, **reinforce), 8)
    with pytest.raises(ValueError, match="needs its old log-probs"):
        build_rollout_batch(_config(tiny_model_dir, **{"global-batch-size": 4}), _samples(), None, device="cpu")


def test_one_step_rollout_trains_as_with_a_separate_old_log_prob_pass(tiny_model_dir):
    cfg = _config(tiny_model_dir, **{"use-tis": True})  # TIS reads the old log-probs too
    samples = _samples()
    fused, separate = TorchTrainBackend(cfg), TorchTrainBackend(cfg)
    fused_metrics = fused.train_rollout(samples)
    rollout = build_rollout_batch(cfg, samples, separate.log_probs(samples), device=separate.device)
    separate_metrics = separate._optimizer_step(samples, list(range(len(samples))), rollout)

    changed = [(a - b).abs().max().item() for a, b in zip(fused.model.parameters(), separate.model.parameters())]
    assert max(changed) < 1e-6
    start = TorchTrainBackend(cfg)
    assert max((a - b).abs().max().item() for a, b in zip(fused.model.parameters(), start.model.parameters())) > 1e-4
    assert fused_metrics["train/ppo_kl"] == 0.0
    for key in ("train/pg_loss", "train/entropy_loss", "train/train_rollout_logprob_abs_diff", "train/grad_norm"):
        assert fused_metrics[key] == pytest.approx(separate_metrics[key], rel=1e-5, abs=1e-7), key
    assert fused_metrics["train/train_rollout_logprob_abs_diff"] > 0  # the agreement metric is still measured
