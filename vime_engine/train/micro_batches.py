"""How a backend cuts its share of an optimizer step into micro-batches, shared by the training backends.

`--micro-batch-size N` (without `--use-dynamic-batch-size`): runs of N samples. Otherwise, the default: micro-batches
of samples of similar length within a token budget, `--max-tokens-per-gpu` or, when not given, as many tokens as the
training activations of this model fit in a share of the device's memory (never fewer than the longest sample at
hand, which always runs). Both backends pad a micro-batch's rows to its longest sample, so the budget counts padded
tokens (rows x longest: what the forward computes and holds) and a micro-batch keeps its padding small.
One forward over many samples instead of one per sample is where the trainer's time goes on small models; padding
is where it goes at long, uneven responses (a quarter of them at a 512-token cap: half the padded batch was padding).

The torch backend's unit is a forward row rather than a sample: the samples of one prompt (GRPO's n) can share a
row that runs their prompt once (vime_engine.train.forward_rows), where the model's attention cost allows; a row
then counts as one sample of its length. SmolLM2, 4 samples of each 44-token prompt at a 64-token cap: 0.74x the
training time per rollout (bench/peer_trl.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from vime_engine.algorithms.packing import (
    fixed_size_micro_batches,
    pack_by_padded_length,
    shared_prompt_rows,
    shared_row_tokens,
)
from vime_engine.config import TrainConfig

# Share of the device memory the training activations of one micro-batch may take; the rest holds the weights,
# gradients, optimizer state (and, on CPU, everything else on the machine).
ACTIVATION_MEMORY_SHARE = 0.25
# Most of a micro-batch's padded tokens that may be padding: more wastes compute on padding, less cuts the rollout
# into more, smaller forwards (each with its fixed cost).
MAX_PADDING_SHARE = 0.25


def activation_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """Rough bytes one token's training forward keeps for the backward: per layer, the attention block's inputs
    and outputs (~16 x hidden) and the MLP's (~4 x intermediate); at the head, the logits and the softmax work
    (~3 x vocabulary)."""
    hidden = hf_config.hidden_size
    intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    per_token = hf_config.num_hidden_layers * (16 * hidden + 4 * intermediate) + 3 * hf_config.vocab_size
    return per_token * torch.finfo(dtype).bits // 8


def device_memory_bytes(device: torch.device) -> int:
    """Free memory of an accelerator (its runtime's `mem_get_info`), or the machine's RAM for the CPU."""
    if device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return getattr(torch, device.type).mem_get_info(device)[0]


def derived_max_tokens(hf_config, dtype: torch.dtype, device: torch.device) -> int:
    """The token budget of a micro-batch when `--max-tokens-per-gpu` is not given."""
    budget = int(device_memory_bytes(device) * ACTIVATION_MEMORY_SHARE)
    return max(1, budget // activation_bytes_per_token(hf_config, dtype))


def attention_pair_cost(hf_config) -> float:
    """A query-key pair's attention work in a forward (q.k and the weighted v: 4 x query width per layer) relative
    to a token's work in the layers' matrix multiplies (2 x their weights): how much longer rows cost beyond their
    tokens (vime_engine.algorithms.packing.shared_prompt_rows)."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    weights = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate
    return 4 * heads * head_dim / (2 * weights)


def plan_micro_batches(train: TrainConfig, lengths: Sequence[int], derived_budget: int) -> list[list[int]]:
    """Sample indices of each micro-batch (see the module docstring); `lengths` are the samples' total tokens."""
    if train.micro_batch_size is not None and not train.use_dynamic_batch_size:
        return fixed_size_micro_batches(len(lengths), train.micro_batch_size)
    return pack_by_padded_length(lengths, _token_budget(train, lengths, derived_budget), MAX_PADDING_SHARE)


def plan_shared_prompt_micro_batches(train: TrainConfig, prompts: Sequence[Sequence[int]],
                                     response_lengths: Sequence[int], derived_budget: int,
                                     pair_cost: float | None) -> list[list[list[int]]]:
    """Micro-batches of forward rows, each row the indices of samples that share their prompt in one forward row
    (vime_engine.train.forward_rows; `pair_cost` None: a row per sample). By token budget (the default), rows are
    formed first and packed like samples; with `--micro-batch-size N`, the runs of N samples are kept and their
    rows formed within them."""
    lengths = [len(p) + r for p, r in zip(prompts, response_lengths, strict=True)]
    budget = _token_budget(train, lengths, derived_budget)

    def rows_of(indices: Sequence[int]) -> list[list[int]]:
        if pair_cost is None:
            return [[i] for i in indices]
        rows = shared_prompt_rows([prompts[i] for i in indices], [response_lengths[i] for i in indices],
                                  pair_cost, budget)
        return [[indices[j] for j in row] for row in rows]

    if train.micro_batch_size is not None and not train.use_dynamic_batch_size:
        return [rows_of(mb) for mb in fixed_size_micro_batches(len(lengths), train.micro_batch_size)]
    rows = rows_of(range(len(lengths)))
    row_lengths = [shared_row_tokens(len(prompts[row[0]]), response_lengths, row) for row in rows]
    return [[rows[i] for i in mb] for mb in pack_by_padded_length(row_lengths, budget, MAX_PADDING_SHARE)]


def _token_budget(train: TrainConfig, lengths: Sequence[int], derived_budget: int) -> int:
    """`--max-tokens-per-gpu`, or the derived budget, never below the longest sample."""
    return train.max_tokens_per_gpu if train.max_tokens_per_gpu is not None else max(derived_budget, *lengths, 1)
