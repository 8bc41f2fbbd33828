"""TP=2 over two real CPU processes (gloo) reproduces the single-process backend."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.megatron.helpers import fixed_rollout, tiny_config
from tests.support.ports import free_port
from vime_engine.train.megatron_backend import MegatronTrainBackend

ROOT = Path(__file__).resolve().parents[2]


def test_tp2_matches_tp1(tiny_qwen3, tmp_path):
    out, port = tmp_path / "tp2.pt", free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.megatron.tp_worker", str(r), "2", str(port), str(tiny_qwen3), str(out)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(log[-3000:] for log in logs)
    tp2 = torch.load(out)
    assert tp2["fc1_shard"] == (256, 128)  # gate+up (2 × 256) split over two ranks: the model really is sharded

    single = MegatronTrainBackend(tiny_config(tiny_qwen3))
    samples = fixed_rollout(single.vocab_size)
    assert (tp2["log_probs"] - single.log_probs(samples)).abs().max().item() < 1e-5
    metrics = single.train_rollout(samples)
    for key in ("train/pg_loss", "train/ppo_kl", "train/entropy_loss"):
        assert abs(tp2["metrics"][key] - metrics[key]) < 1e-5, key
    weights = dict(single.named_weights())
    assert set(tp2["weights"]) == set(weights)
    assert max((tp2["weights"][n] - weights[n]).abs().max().item() for n in weights) < 5e-5
