"""The cheapest micro-batches within a padded-token budget are the default; `--micro-batch-size` alone keeps runs of
N samples."""

import pytest
import torch
from transformers import Qwen3Config

from vime_engine.config import build_config
from vime_engine.train.micro_batches import (
    activation_bytes_per_token,
    derived_max_tokens,
    micro_batch_fixed_tokens,
    plan_micro_batches,
    plan_shared_prompt_micro_batches,
)

LENGTHS = [30, 10, 50, 20, 40]


def _train(**flags):
    return build_config([], **{"hf-checkpoint": "unused", "prompt-data": "unused", **flags}).train


def test_default_is_a_token_budget_never_below_the_longest_sample():
    # Fixed cost 25: 50, 40 padded to 100 and 30, 20, 10 to 90, 240 in all (as little as 50, 40, 30 with 20, 10),
    # against 245 with 50 alone and 275 in one micro-batch.
    assert plan_micro_batches(_train(), LENGTHS, derived_budget=1000, fixed_tokens=25) == [[0, 1, 3], [2, 4]]
    # A derived budget below the longest sample becomes that sample's length (50: only 20 and 10 fit together),
    # rather than refusing the rollout.
    assert plan_micro_batches(_train(), LENGTHS, derived_budget=5, fixed_tokens=25) == [[0], [1, 3], [2], [4]]


def test_explicit_flags_win():
    assert plan_micro_batches(_train(**{"micro-batch-size": 2}), LENGTHS, 1000, 15) == [[0, 1], [2, 3], [4]]
    budget = _train(**{"max-tokens-per-gpu": 60})
    # 2 x 30 fits 60, 2 x 40 does not; 30 + 20 and 20 + 10 cost the same, the first found (from the shortest) wins
    assert plan_micro_batches(budget, LENGTHS, 10_000, 15) == [[0], [1, 3], [2], [4]]
    both = _train(**{"micro-batch-size": 2, "use-dynamic-batch-size": True, "max-tokens-per-gpu": 100})
    assert plan_micro_batches(both, LENGTHS, 1, 15) == [[0, 4], [1, 3], [2]]  # the budget wins: 2 x 50 fits 100
    with pytest.raises(ValueError, match="--max-tokens-per-gpu"):
        plan_micro_batches(_train(**{"max-tokens-per-gpu": 40}), LENGTHS, 10_000, 15)


def test_derived_budget_scales_with_the_model_and_the_memory():
    small = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=1000)
    large = Qwen3Config(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, vocab_size=150_000)
    assert activation_bytes_per_token(small, torch.float32) == 2 * activation_bytes_per_token(small, torch.bfloat16)
    cpu = torch.device("cpu")
    assert derived_max_tokens(small, torch.float32, cpu) > 50 * derived_max_tokens(large, torch.float32, cpu) > 0


def test_a_micro_batch_costs_more_tokens_of_a_smaller_model():
    small = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=434,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # tiny-qwen3
    large = Qwen3Config(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64)  # SmolLM2-135M's shapes
    cpu = torch.device("cpu")
    # the host's 2.5 ms are worth ~240 tokens of the tiny model and under one of SmolLM2; the passes over the
    # weights 100 of either on CPU
    assert micro_batch_fixed_tokens(small, cpu) == pytest.approx(100 + 238, abs=1)
    assert micro_batch_fixed_tokens(large, cpu) == pytest.approx(100 + 0.6, abs=0.1)
    # an accelerator does the same work sooner, so the host's part is worth more tokens there
    assert micro_batch_fixed_tokens(large, torch.device("cuda")) > 10 * micro_batch_fixed_tokens(large, cpu)


def test_rows_share_prompts_within_the_plan():
    prompts, responses = [[1, 2], [3], [1, 2], [1, 2]], [5, 30, 6, 4]
    # By token budget: rows first (the three samples of [1, 2] in one of 17 tokens), then packed as samples are:
    # rows of 31 and 17 tokens pad to 62 (+ 20 fixed) against 48 + 40 apart: one micro-batch.
    assert plan_shared_prompt_micro_batches(_train(), prompts, responses, 1000, 20, pair_cost=0.0) == [
        [[0, 2, 3], [1]]]
    assert plan_shared_prompt_micro_batches(_train(**{"max-tokens-per-gpu": 40}), prompts, responses, 1000, 20,
                                            pair_cost=0.0) == [[[0, 2, 3]], [[1]]]
    # Without a fixed cost, padding never pays.
    assert plan_shared_prompt_micro_batches(_train(), prompts, responses, 1000, 0, pair_cost=0.0) == [
        [[0, 2, 3]], [[1]]]
    # --micro-batch-size 2 keeps its runs of two samples; rows form within them.
    fixed = _train(**{"micro-batch-size": 2})
    assert plan_shared_prompt_micro_batches(fixed, prompts, responses, 1000, 20, 0.0) == [[[0], [1]], [[2, 3]]]
    # No pair cost (an attention without custom masks): a row per sample, the plan of plan_micro_batches.
    lengths = [len(p) + r for p, r in zip(prompts, responses)]
    assert plan_shared_prompt_micro_batches(_train(), prompts, responses, 1000, 20, None) == [
        [[i] for i in mb] for mb in plan_micro_batches(_train(), lengths, 1000, 20)]
