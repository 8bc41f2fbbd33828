"""How a backend cuts its share of an optimizer step into micro-batches, shared by the training backends.

`--micro-batch-size N` (without `--use-dynamic-batch-size`): runs of N samples. Otherwise, the default: the
cheapest micro-batches within a token budget, `--max-tokens-per-gpu` or, when not given, as many tokens as the
training activations of this model fit in a share of the device's memory (never fewer than the longest sample at
hand, which always runs). Both backends pad a micro-batch's rows to its longest sample, so the budget counts padded
tokens (rows x longest: what the forward computes and holds), and the micro-batches are the cheapest in padded
tokens' work plus a fixed cost each (MicroBatchFixedCost; vime_engine.algorithms.packing). On CPU that fixed cost is
worth about 100 tokens of SmolLM2-135M and 340 of the tiny test model. Against micro-batches that allowed a quarter
of their tokens to be padding, bench/train_step.py: SmolLM2 with a quarter of the responses at a 512-token cap, 0.88x
the training time per rollout; the demo's rollout 0.89x; a 64-token cap, rows of equal length, 0.99x; tiny 0.91x.

The torch backend's unit is a forward row rather than a sample: the samples of one prompt (GRPO's n) can share a
row that runs their prompt once (vime_engine.train.forward_rows); a row then counts as one sample of its length.
SmolLM2, 4 samples of each 44-token prompt at a 64-token cap: 0.74x the training time per rollout
(bench/peer_trl.py). Where each sample's attention runs on its own tokens (vime_engine.train.sample_attention), a
longer row adds no attention, and the samples of a prompt share one row within the budget (pair cost 0); where
SDPA takes the rows' mask, the row's query-key pairs count too (`attention_pair_cost`), and a prompt's samples
share rows where that cost allows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class MicroBatchFixedCost:
    """What a micro-batch costs whatever its tokens, on one kind of device: the host's dispatch of its forward and
    backward, as the matrix work (FLOPs) it equals, and its passes over the weights and their gradients (read in the
    forward and the backward, added into: about 16 bytes a weight, against a token's 6 FLOPs a weight), as the
    tokens whose work takes as long."""

    host_flops: float
    weight_pass_tokens: float


# CPU, measured on 2 cores (bench/train_step.py's cases, the seconds of a rollout's training): tiny-qwen3, 16 rows
# as 16 micro-batches 0.113 s against 0.075 s as one, 2.5 ms each at the ~190 GFLOP/s the cores reach in fp32
# products; SmolLM2-135M, the least time at 100-150 tokens a micro-batch (the demo's rollout: 8 micro-batches
# 13.9 CPU s, 2 at 100 tokens 11.3 s; a quarter of the responses at a 512-token cap: 9 micro-batches 67.7 s, 5 at
# 150 tokens 64.4 s). An accelerator: estimated, not measured here (~5 ms of host work at ~3e14 FLOP/s; ~200 FLOPs
# a byte of its memory's bandwidth).
MICRO_BATCH_FIXED_COSTS = {"cpu": MicroBatchFixedCost(host_flops=5e8, weight_pass_tokens=100)}
ACCELERATOR_MICRO_BATCH_FIXED_COST = MicroBatchFixedCost(host_flops=1.5e12, weight_pass_tokens=500)


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


def _head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def _layer_weights(hf_config) -> int:
    """The weights of one layer's matrix multiplies: the attention projections (q and o, k and v) and a gated MLP."""
    hidden, head_dim = hf_config.hidden_size, _head_dim(hf_config)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    intermediate = getattr(hf_config, "intermediate_size", None) or 4 * hidden
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate


def attention_pair_cost(hf_config) -> float:
    """A query-key pair's attention work in a forward (q.k and the weighted v: 4 x query width per layer) relative
    to a token's work in the layers' matrix multiplies (2 x their weights): how much longer rows cost beyond their
    tokens (vime_engine.algorithms.packing)."""
    return 4 * hf_config.num_attention_heads * _head_dim(hf_config) / (2 * _layer_weights(hf_config))


def micro_batch_fixed_tokens(hf_config, device: torch.device) -> float:
    """A micro-batch's fixed cost (MICRO_BATCH_FIXED_COSTS of `device`'s kind) in tokens of this model's training
    work: forward and backward, 6 FLOPs a weight a token passes, the layers' and the LM head's."""
    cost = MICRO_BATCH_FIXED_COSTS.get(device.type, ACCELERATOR_MICRO_BATCH_FIXED_COST)
    flops_per_token = 6 * (hf_config.num_hidden_layers * _layer_weights(hf_config)
                           + hf_config.vocab_size * hf_config.hidden_size)
    return cost.host_flops / flops_per_token + cost.weight_pass_tokens


def plan_micro_batches(train: TrainConfig, lengths: Sequence[int], derived_budget: int,
                       fixed_tokens: float) -> list[list[int]]:
    """Sample indices of each micro-batch (see the module docstring); `lengths` are the samples' total tokens,
    `fixed_tokens` a micro-batch's fixed cost (`micro_batch_fixed_tokens`)."""
    if train.micro_batch_size is not None and not train.use_dynamic_batch_size:
        return fixed_size_micro_batches(len(lengths), train.micro_batch_size)
    return pack_by_padded_length(lengths, _token_budget(train, lengths, derived_budget), fixed_tokens)


def plan_shared_prompt_micro_batches(train: TrainConfig, prompts: Sequence[Sequence[int]],
                                     response_lengths: Sequence[int], derived_budget: int, fixed_tokens: float,
                                     pair_cost: float | None) -> list[list[list[int]]]:
    """Micro-batches of forward rows, each row the indices of samples that share their prompt in one forward row
    (vime_engine.train.forward_rows; `pair_cost` None: a row per sample). By token budget (the default), rows are
    formed first and packed like samples, padded rows' attention counted at `pair_cost`; with
    `--micro-batch-size N`, the runs of N samples are kept and their rows formed within them."""
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
    return [[rows[i] for i in mb] for mb in pack_by_padded_length(row_lengths, budget, fixed_tokens, pair_cost or 0.0)]


def _token_budget(train: TrainConfig, lengths: Sequence[int], derived_budget: int) -> int:
    """`--max-tokens-per-gpu`, or the derived budget, never below the longest sample."""
    return train.max_tokens_per_gpu if train.max_tokens_per_gpu is not None else max(derived_budget, *lengths, 1)
