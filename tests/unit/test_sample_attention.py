"""Per-sample attention over shared-prompt rows against SDPA with the rows' mask (the definition), values and
gradients, and the units it batches."""

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from vime_engine.sample import Sample
from vime_engine.train.forward_rows import build_forward_rows
from vime_engine.train.sample_attention import sample_attention_forward, sample_attention_layout

HEADS, KV_HEADS, DIM = 6, 2, 8
ATTENTION = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True)  # what HF's SDPA reads


def _rows(seed: int) -> list[list[Sample]]:
    """Rows of one to four samples sharing prompts of different lengths, responses from 1 to 40 tokens (so the
    units fall into batches of different lengths), and a row of a single sample."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(10, 90) for _ in range(n)]  # noqa: E731
    rows = []
    for size in (4, 1, 3):
        prompt = tokens(rng.randrange(1, 9))
        rows.append([Sample(0, "", "", prompt, tokens(rng.choice([1, 2, 5, 17, 40]))) for _ in range(size)])
    return rows


@pytest.mark.parametrize(("seed", "value_dim"), [(0, DIM), (1, DIM), (2, DIM), (3, 3)])
def test_outputs_and_gradients_match_sdpa_with_the_rows_mask(seed, value_dim):
    """value_dim 3: multi-latent attention's values are narrower than its queries and keys."""
    layout = build_forward_rows(_rows(seed), torch.device("cpu"))
    rows, length = layout.input_ids.shape
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, HEADS, length, DIM, generator=generator, dtype=torch.float64)
    key = torch.randn(rows, KV_HEADS, length, DIM, generator=generator, dtype=torch.float64)
    value = torch.randn(rows, KV_HEADS, length, value_dim, generator=generator, dtype=torch.float64)
    weights = torch.randn(rows, length, HEADS, value_dim, generator=generator, dtype=torch.float64)
    weights *= layout.tokens[:, :, None, None]  # padding positions' outputs are read by nothing

    def run(attend):
        leaves = [t.clone().requires_grad_(True) for t in (query, key, value)]
        out = attend(*leaves)
        (out * weights).sum().backward()
        return out.detach() * layout.tokens[:, :, None, None], [t.grad for t in leaves]

    units = sample_attention_layout(layout)
    ours = run(lambda q, k, v: sample_attention_forward(ATTENTION, q, k, v, None, scaling=0.3,
                                                        sample_attention=units)[0])
    masked = run(lambda q, k, v: F.scaled_dot_product_attention(
        q, repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS), attn_mask=layout.attention_mask,
        scale=0.3).transpose(1, 2))
    torch.testing.assert_close(ours[0], masked[0])
    for name, got, expected in zip("qkv", ours[1], masked[1], strict=True):
        torch.testing.assert_close(got, expected, msg=name)


def test_units_cover_every_token_once_in_batches_by_length():
    layout = build_forward_rows(_rows(0), torch.device("cpu"))
    units = sample_attention_layout(layout)
    tokens = layout.tokens.flatten().nonzero().flatten()
    assert sorted(units.positions.tolist()) == tokens.tolist()
    assert len(units.batches) > 1  # 40-token responses and 1-token ones are not padded to one length
    slots = sum(batch.queries.numel() for batch in units.batches)
    assert units.slots.unique().numel() == units.slots.numel() and int(units.slots.max()) < slots
    for batch in units.batches:  # every query slot, padding included, sees a key: no softmax over nothing
        assert batch.visible.any(dim=-1).all()


def test_without_units_it_is_sdpa():
    layout = build_forward_rows(_rows(1), torch.device("cpu"))
    rows, length = layout.input_ids.shape
    query = torch.randn(rows, HEADS, length, DIM)
    key, value = torch.randn(rows, KV_HEADS, length, DIM), torch.randn(rows, KV_HEADS, length, DIM)
    ours, _ = sample_attention_forward(ATTENTION, query, key, value, layout.attention_mask, scaling=0.5)
    expected, _ = sdpa_attention_forward(ATTENTION, query, key, value, layout.attention_mask, scaling=0.5)
    assert torch.equal(ours, expected)
