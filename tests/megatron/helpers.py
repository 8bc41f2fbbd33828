"""Shared by the Megatron tests and the TP=2 worker processes: a fixed config and a fixed rollout."""

from __future__ import annotations

import random
from pathlib import Path

from vime_engine.config import EngineConfig, from_flat
from vime_engine.sample import Sample


def tiny_config(model_dir: Path, **overrides) -> EngineConfig:
    values = {
        "hf_checkpoint": str(model_dir), "prompt_data": "unused.jsonl", "rollout_batch_size": 2,
        "n_samples_per_prompt": 4, "global_batch_size": 4, "micro_batch_size": 2, "lr": 1e-3,
        "num_rollout": 4, "seed": 7, "train_backend": "megatron",
    }
    values.update(overrides)
    return from_flat(values)


def fixed_rollout(vocab_size: int, seed: int = 0) -> list[Sample]:
    """Two prompts × four responses of varying lengths, varied rewards, a masked-out token."""
    rng = random.Random(seed)
    samples = []
    for group in range(2):
        prompt = [rng.randrange(3, vocab_size) for _ in range(5 + group)]
        for k in range(4):
            response = [rng.randrange(3, vocab_size) for _ in range(3 + 2 * k)]
            mask = [1] * len(response)
            mask[0] = 0 if k == 1 else 1
            samples.append(Sample(
                group_index=group, prompt="", label="", prompt_tokens=prompt, response_tokens=response,
                rollout_log_probs=[-rng.uniform(4.0, 7.0) for _ in response], loss_mask=mask,
                reward=float((k * 7 + group) % 3),
            ))
    return samples
