"""Attention over forward rows where samples share their prompt (vime_engine.train.forward_rows), computed per
sample instead of over the whole row.

In a row of a prompt and k responses, a response token sees the prompt and the earlier tokens of its own response,
not the other responses. SDPA with the row's mask computes every query-key pair of the row and masks afterwards
(torch's CPU flash kernel skips no block at these lengths), so the row costs about k times its samples' own
attention. Here a layer gathers, for each *unit*, its queries and the keys they may see, and runs SDPA on a batch
of units padded to the batch's longest:

- a prompt unit: the row's prompt positions, each attending to the prompt positions up to itself;
- a response unit: one sample's response positions, its keys the prompt and then the response, each query
  attending to the prompt and to its response up to itself.

The outputs go back to the rows' positions; a padding position's is zero (no loss reads it). A unit's key j is
visible to its query i when j <= offset + i, where offset is the count of its keys that are not queries (0 for a
prompt, the prompt's length for a response): every query sees exactly the keys it sees in the row's mask, so the
outputs equal the masked SDPA's up to the order of float sums. Units are batched by dynamic programming over their
key counts (vime_engine.algorithms.packing.pack_by_padded_length): a batch of n units whose longest has K keys costs
about n * K**2 query-key pairs, plus a fixed cost per batch (its SDPA call and gathers, forward and backward).
SmolLM2-135M's attention shapes, 2 CPU threads, one layer's forward and backward over 4 rows of a 44-token prompt
and 4 responses: 64-token responses, 27 ms with the rows' mask against 18 ms in 2 batches of units; a quarter of
the responses at 512 tokens and the rest of 64-255, 676 ms against 148 ms in 6 batches.

The attention is HF transformers' (`AttentionInterface`), under the name ATTENTION; a model set to it runs torch's
SDPA, with SDPA's masks, whenever a forward is not given `sample_attention` (a call from outside the trainer's
rows). Like the rows' mask before it, it knows no sliding window or logit soft cap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vime_engine.algorithms.packing import pack_by_padded_length
from vime_engine.train.forward_rows import ForwardRows

ATTENTION = "vime_sample_attention"
# A batch of units' fixed cost in query-key pairs: ~0.7 ms a call (its gathers, SDPA and their backward) against
# ~0.06 us a pair of keys squared (SmolLM2-135M's 9 heads of 64, 2 CPU threads).
UNIT_BATCH_FIXED_PAIRS = 12_000.0


@dataclass(frozen=True)
class UnitBatch:
    """Units padded to the batch's longest; positions are in the rows flattened to [rows × length] (a padding slot
    holds position 0, a real key that it keeps finite)."""
    keys: Tensor  # [units, K]
    queries: Tensor  # [units, Q]
    visible: Tensor  # [units, 1, Q, K] bool: the query (dim 2) attends to the key (dim 3)


@dataclass(frozen=True)
class SampleAttention:
    """One forward's units, batched: each real query slot of the batches' outputs, in batch order then unit
    order then query order (`slots`, into the concatenated [units × Q] outputs), and its row position
    (`positions`)."""
    batches: tuple[UnitBatch, ...]
    slots: Tensor
    positions: Tensor


def sample_attention_layout(rows: ForwardRows) -> SampleAttention:
    """The units of the samples of `rows` (their spans: row, prompt length, response start, response length), on
    the rows' device."""
    length, device = rows.input_ids.shape[1], rows.input_ids.device
    units: list[tuple[list[int], int]] = []  # (keys as row positions, how many of them are not queries)
    prompted_rows = set()
    for row, prompt, start, response in rows.spans:
        base = row * length
        prompt_keys = list(range(base, base + prompt))
        if prompt and row not in prompted_rows:
            prompted_rows.add(row)
            units.append((prompt_keys, 0))
        if response:
            units.append((prompt_keys + list(range(base + start, base + start + response)), prompt))
    key_counts = [len(keys) for keys, _ in units]
    plan = pack_by_padded_length(key_counts, max(sum(key_counts), 1), UNIT_BATCH_FIXED_PAIRS, pair_cost=1.0)
    batches, slots, positions, offset = [], [], [], 0
    for members in plan:
        keys_max = max(key_counts[u] for u in members)
        queries_max = max(key_counts[u] - units[u][1] for u in members)
        keys = torch.zeros(len(members), keys_max, dtype=torch.long)
        queries = torch.zeros(len(members), queries_max, dtype=torch.long)
        visible = torch.zeros(len(members), 1, queries_max, keys_max, dtype=torch.bool)
        visible[:, 0, :, 0] = True  # a padding query slot sees key slot 0: no row of the softmax is empty
        for n, u in enumerate(members):
            unit_keys, skipped = units[u]
            count = len(unit_keys) - skipped
            keys[n, : len(unit_keys)] = torch.tensor(unit_keys)
            queries[n, :count] = torch.tensor(unit_keys[skipped:])
            visible[n, 0, :count, : len(unit_keys)] = torch.ones(count, len(unit_keys), dtype=torch.bool).tril(skipped)
            slots.extend(range(offset + n * queries_max, offset + n * queries_max + count))
            positions.extend(unit_keys[skipped:])
        offset += len(members) * queries_max
        batches.append(UnitBatch(keys.to(device), queries.to(device), visible.to(device)))
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return SampleAttention(tuple(batches), as_tensor(slots), as_tensor(positions))


def sample_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             sample_attention: SampleAttention | None = None, **kwargs) -> tuple[Tensor, None]:
    """HF's attention-function contract: query and key [rows, heads or kv heads, length, dim], value [rows, kv
    heads, length, value dim] (multi-latent attention's may differ) -> ([rows, length, heads, value dim], no
    weights). Without `sample_attention`, SDPA's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if sample_attention is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, length, _ = query.shape
    value_dim = value.shape[-1]
    repeats = heads // key.shape[1]  # grouped-query attention: each key-value head serves `repeats` query heads

    def flat(states: Tensor) -> Tensor:  # [rows, h, length, d] -> [rows × length, h, d]
        return states.transpose(1, 2).reshape(rows * length, *states.shape[1::2])

    def take(states: Tensor, index: Tensor, repeat: int = 1) -> Tensor:  # -> [units, h × repeat, slots, d]
        taken = states.index_select(0, index.flatten()).view(*index.shape, states.shape[1], 1, states.shape[2])
        return taken.expand(-1, -1, -1, repeat, -1).flatten(2, 3).transpose(1, 2)

    queries, keys, values = flat(query), flat(key), flat(value)
    outputs = []
    for batch in sample_attention.batches:
        out = F.scaled_dot_product_attention(
            take(queries, batch.queries), take(keys, batch.keys, repeats), take(values, batch.keys, repeats),
            attn_mask=batch.visible, dropout_p=dropout, scale=scaling)
        outputs.append(out.transpose(1, 2).reshape(-1, heads, value_dim))
    computed = torch.cat(outputs).index_select(0, sample_attention.slots)
    attended = query.new_zeros(rows * length, heads, value_dim).index_copy(0, sample_attention.positions, computed)
    return attended.view(rows, length, heads, value_dim), None


def use_sample_attention(model: nn.Module) -> bool:
    """Set `model` (an HF model on torch's SDPA) to ATTENTION; whether it now runs it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, sample_attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    if model.config._attn_implementation != "sdpa":
        return False
    model.set_attn_implementation(ATTENTION)
    return model.config._attn_implementation == ATTENTION
