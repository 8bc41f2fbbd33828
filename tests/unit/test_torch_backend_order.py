"""The torch backend's per-token log-probs come back in sample order however the samples were packed."""

from __future__ import annotations

import random

import pytest
import torch

from vime_engine.config import build_config
from vime_engine.models.builtin import materialize_builtin_model
from vime_engine.sample import Sample
from vime_engine.train.torch_backend import TorchTrainBackend


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return materialize_builtin_model("tiny-qwen3", tmp_path_factory.mktemp("tiny") / "model")


def _samples() -> list[Sample]:
    rng = random.Random(0)
    return [
        Sample(i // 4, "", "", [rng.randrange(10, 90) for _ in range(rng.randrange(4, 20))],
               [rng.randrange(10, 90) for _ in range(rng.randrange(2, 16))])
        for i in range(8)
    ]


def test_packed_micro_batches_give_the_same_log_probs_as_one_sample_at_a_time(tiny_model_dir):
    base = {"hf-checkpoint": str(tiny_model_dir), "prompt-data": "unused", "rollout-batch-size": 2,
            "n-samples-per-prompt": 4}
    samples = _samples()
    one_by_one = TorchTrainBackend(build_config([], **base, **{"micro-batch-size": 1})).log_probs(samples)
    packed_backend = TorchTrainBackend(build_config([], **base, **{"use-dynamic-batch-size": True,
                                                                   "max-tokens-per-gpu": 40}))
    micro_batches = packed_backend._micro_batches(samples)
    assert [i for mb in micro_batches for row in mb for i in row] != list(range(len(samples)))  # packing reordered
    torch.testing.assert_close(packed_backend.log_probs(samples), one_by_one, atol=1e-5, rtol=0)
