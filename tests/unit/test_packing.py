"""Micro-batch packing: hand-traced cases and invariants over random lengths."""

from __future__ import annotations

import random

import pytest

from vime_engine.algorithms.packing import (
    balanced_shares,
    fixed_size_micro_batches,
    pack_by_padded_length,
    shared_prompt_rows,
    split_to_count,
)


def test_padding_is_worth_a_micro_batch_only_where_it_costs_less_by_hand() -> None:
    # lengths [50, 10, 48, 12, 11], longest first: 50 (i0), 48 (i2), 12 (i3), 11 (i4), 10 (i1).
    # Fixed cost 0: padding never pays, so every length runs alone.
    assert pack_by_padded_length([50, 10, 48, 12, 11], 1000, 0) == [[0], [1], [2], [3], [4]]
    # Fixed cost 5: {50, 48} pads 2 tokens (100 + 5 < 98 + 10), {12, 11, 10} pads 3 (36 + 5 < 33 + 15);
    # {50, 48, 12} would pad 38.
    assert pack_by_padded_length([50, 10, 48, 12, 11], 1000, 5) == [[0, 2], [1, 3, 4]]
    # Fixed cost 200: one micro-batch of 250 padded tokens (250 + 200 against 100 + 36 + 400)
    assert pack_by_padded_length([50, 10, 48, 12, 11], 1000, 200) == [[0, 1, 2, 3, 4]]
    # the budget counts padded tokens: 3 x 50 > 120
    assert pack_by_padded_length([50, 48, 45], 1000, 100) == [[0, 1, 2]]
    assert pack_by_padded_length([50, 48, 45], 120, 100) == [[0, 1], [2]]


def test_attention_makes_long_padded_rows_cost_more_by_hand() -> None:
    # [100, 60], fixed cost 50: together 200 + 50 against 160 + 100 without attention; a pair cost of 0.01 adds
    # 2 x 100 for the padded pair against 100 + 36 apart.
    assert pack_by_padded_length([100, 60], 1000, 50) == [[0, 1]]
    assert pack_by_padded_length([100, 60], 1000, 50, pair_cost=0.01) == [[0], [1]]


def test_exact_fits_ties_and_empty() -> None:
    # four 4s into 8: two per micro-batch at most
    assert pack_by_padded_length([4, 4, 4, 4], 8, 1) == [[0, 1], [2, 3]]
    # no fixed cost: equal lengths still share a micro-batch, as cheap as apart and fewer
    assert pack_by_padded_length([3, 2, 3, 2], 100, 0) == [[0, 2], [1, 3]]
    assert pack_by_padded_length([0, 5, 0], 5, 1) == [[0, 2], [1]]  # empty samples together, not padded to 5
    assert pack_by_padded_length([], 8, 1) == []


def test_a_sample_over_the_budget_names_the_flag_and_a_value() -> None:
    with pytest.raises(ValueError) as err:
        pack_by_padded_length([3, 9, 7], 5, 1)
    message = str(err.value)
    assert "--max-tokens-per-gpu=5" in message
    assert "sample 1 has 9 tokens" in message
    assert "at least 9" in message


def test_invalid_budget_costs_or_length() -> None:
    with pytest.raises(ValueError, match="--max-tokens-per-gpu must be > 0"):
        pack_by_padded_length([1], 0, 1)
    with pytest.raises(ValueError, match="fixed_cost and pair_cost must be >= 0"):
        pack_by_padded_length([1], 4, -1)
    with pytest.raises(ValueError, match="negative length"):
        pack_by_padded_length([1, -1], 4, 1)


def _cost(bins: list[list[int]], lengths: list[int], fixed: float, pair: float) -> float:
    return sum(len(m) * (max(lengths[i] for i in m) + pair * max(lengths[i] for i in m) ** 2) + fixed for m in bins)


def _partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest):
        yield [[first], *partition]
        for k in range(len(partition)):
            yield [*partition[:k], [first, *partition[k]], *partition[k + 1:]]


def test_no_partition_is_cheaper_over_random_lengths() -> None:
    # Against every partition of up to 7 samples (877 of them), not only the runs the packing searches.
    rng = random.Random(20261204)
    for _ in range(60):
        lengths = [rng.randint(0, 40) for _ in range(rng.randint(1, 7))]
        max_tokens = rng.randint(max(lengths + [1]), 4 * max(lengths) + 1)
        fixed, pair = rng.choice([0, 1, 7.5, 40]), rng.choice([0.0, 0.01])
        bins = pack_by_padded_length(lengths, max_tokens, fixed, pair)
        feasible = [p for p in _partitions(list(range(len(lengths))))
                    if all(len(m) == 1 or len(m) * max(lengths[i] for i in m) <= max_tokens for m in p)]
        cheapest = min(_cost(p, lengths, fixed, pair) for p in feasible)
        assert _cost(bins, lengths, fixed, pair) == pytest.approx(cheapest)


def test_packing_invariants_over_random_lengths() -> None:
    rng = random.Random(20261129)
    for _ in range(300):
        max_tokens = rng.randint(1, 4096)
        fixed = rng.choice([0, 1, 50, 500])
        lengths = [rng.randint(0, max_tokens) for _ in range(rng.randint(0, 64))]
        bins = pack_by_padded_length(lengths, max_tokens, fixed)

        flat = [i for members in bins for i in members]
        assert sorted(flat) == list(range(len(lengths)))  # every index exactly once
        for members in bins:
            assert members  # no empty micro-batch
            assert members == sorted(members)  # ascending within a bin
            assert len(members) * max(lengths[i] for i in members) <= max_tokens  # budget in padded tokens
            if fixed == 0:
                assert len({lengths[i] for i in members}) == 1  # padding never pays for itself
        assert [members[0] for members in bins] == sorted(members[0] for members in bins)
        # never costlier than a micro-batch per sample
        assert _cost(bins, lengths, fixed, 0.0) <= sum(lengths) + fixed * len(lengths)
        assert pack_by_padded_length(list(lengths), max_tokens, fixed) == bins  # deterministic


def test_fixed_size_micro_batches() -> None:
    assert fixed_size_micro_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert fixed_size_micro_batches(6, 3) == [[0, 1, 2], [3, 4, 5]]
    assert fixed_size_micro_batches(0, 3) == []
    with pytest.raises(ValueError, match="--micro-batch-size must be >= 1"):
        fixed_size_micro_batches(4, 0)


def test_balanced_shares_hand_worked():
    # Longest first, each to the lighter share: 9 → 0, 7 → 1, 5 → 1 (7 < 9), 4 → 0 (9 < 12).
    shares = balanced_shares([9, 7, 5, 4], 2)
    assert shares == [[0, 3], [1, 2]]  # 13 and 12 tokens; round-robin would give 14 and 11
    assert balanced_shares([1, 1, 1, 1, 1], 2) == [[0, 2, 4], [1, 3]]


def test_balanced_shares_invariants():
    import random

    rng = random.Random(3)
    for _ in range(200):
        n, k = rng.randrange(0, 40), rng.randrange(1, 6)
        lengths = [rng.randrange(1, 100) for _ in range(n)]
        shares = balanced_shares(lengths, k)
        assert sorted(i for share in shares for i in share) == list(range(n))
        sizes = [len(share) for share in shares]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
        assert all(share == sorted(share) for share in shares)


def test_split_to_count_halves_the_fullest_micro_batch_then_adds_empty_ones_by_hand() -> None:
    assert split_to_count([[0, 1, 2], [3]], 2) == [[0, 1, 2], [3]]
    assert split_to_count([[0, 1, 2], [3]], 3) == [[0, 1], [2], [3]]
    assert split_to_count([[0, 1, 2], [3]], 4) == [[0], [1], [2], [3]]
    assert split_to_count([[0, 1, 2], [3]], 6) == [[0], [1], [2], [3], [], []]
    assert split_to_count([], 2) == [[], []]
    with pytest.raises(ValueError, match="cannot make 2 micro-batches into 1"):
        split_to_count([[0], [1]], 1)


@pytest.mark.parametrize("seed", range(20))
def test_split_to_count_keeps_every_index_in_order_and_grows_no_micro_batch(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(0, 24))]
    plan = pack_by_padded_length(lengths, 600, 30)
    count = len(plan) + rng.randint(0, 10)
    split = split_to_count(plan, count)
    assert len(split) == count
    assert [i for mb in split for i in mb] == [i for mb in plan for i in mb]
    assert max((len(mb) for mb in split), default=0) <= max((len(mb) for mb in plan), default=0)
    assert all(any(set(mb) <= set(whole) for whole in plan) for mb in split if mb)


A, B = [1, 2, 3], [4, 5]


def test_shared_prompt_rows_by_hand() -> None:
    prompts, responses = [A, B, A, A], [2, 5, 2, 2]
    # Attention free: A's three samples share one row of 3 + 6 tokens.
    assert shared_prompt_rows(prompts, responses, pair_cost=0.0, max_tokens=100) == [[0, 2, 3], [1]]
    # pair_cost 2: one row of 9 costs 9 + 162 = 171, three rows of 5 cost 3 x (5 + 50) = 165, two rows (7 and 5
    # tokens: balanced_shares puts A's first and third sample, i0 and i3, together) cost 7 + 98 + 5 + 50 = 160.
    assert shared_prompt_rows(prompts, responses, pair_cost=2.0, max_tokens=100) == [[0, 3], [1], [2]]
    # A budget of 8 rules out the row of 9.
    assert shared_prompt_rows(prompts, responses, pair_cost=0.0, max_tokens=8) == [[0, 3], [1], [2]]
    # Fewer rows win ties: a row of 3 tokens costs 3 + 9 = 12, two rows of 2 cost 2 x (2 + 4) = 12.
    assert shared_prompt_rows([[7], [7]], [1, 1], pair_cost=1.0, max_tokens=10) == [[0, 1]]
    # A sample over the budget still gets its own row (the micro-batch planner then names the flag).
    assert shared_prompt_rows([A, A], [50, 1], pair_cost=0.0, max_tokens=10) == [[0], [1]]
    assert shared_prompt_rows([], [], pair_cost=0.0, max_tokens=10) == []
    with pytest.raises(ValueError, match="2 prompts but 1 response lengths"):
        shared_prompt_rows([A, B], [1], pair_cost=0.0, max_tokens=10)


@pytest.mark.parametrize("seed", range(20))
def test_shared_prompt_rows_invariants(seed: int) -> None:
    rng = random.Random(seed)
    distinct = [[rng.randrange(100) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(1, 5))]
    prompts = [rng.choice(distinct) for _ in range(rng.randint(0, 30))]
    responses = [rng.randint(0, 60) for _ in prompts]
    max_tokens = rng.randint(40, 300)
    rows = shared_prompt_rows(prompts, responses, pair_cost=rng.choice([0.0, 1e-3, 0.1]), max_tokens=max_tokens)
    assert sorted(i for row in rows for i in row) == list(range(len(prompts)))
    assert rows == sorted(rows) and all(row == sorted(row) for row in rows)
    for row in rows:
        assert all(prompts[i] == prompts[row[0]] for i in row)
        if len(row) > 1:
            assert len(prompts[row[0]]) + sum(responses[i] for i in row) <= max_tokens
