"""Micro-batch packing: hand-traced cases and invariants over random lengths."""

from __future__ import annotations

import random

import pytest

from vime_engine.algorithms.packing import balanced_shares, fixed_size_micro_batches, pack_by_token_budget


def test_first_fit_decreasing_by_hand() -> None:
    # lengths [5, 3, 4, 2, 6], budget 8; visit longest first: 6 (i4), 5 (i0), 4 (i2), 3 (i1), 2 (i3)
    #   i4 -> bin A (room 2); i0 -> bin B (room 3); i2 -> bin C (room 4)
    #   i1 (3) -> first with room >= 3 is B -> B = {0, 1}, room 0
    #   i3 (2) -> A has room 2 -> A = {4, 3}, room 0
    # sorted within and across bins: [[0, 1], [2], [3, 4]]
    assert pack_by_token_budget([5, 3, 4, 2, 6], 8) == [[0, 1], [2], [3, 4]]


def test_exact_fits_and_ties_break_by_index() -> None:
    # four 4s into 8: i0 -> A, i1 -> A (full), i2 -> B, i3 -> B
    assert pack_by_token_budget([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    # zero-length samples fit anywhere: the 5 opens A, both zeros join it
    assert pack_by_token_budget([0, 5, 0], 5) == [[0, 1, 2]]
    assert pack_by_token_budget([], 8) == []


def test_a_sample_over_the_budget_names_the_flag_and_a_value() -> None:
    with pytest.raises(ValueError) as err:
        pack_by_token_budget([3, 9, 7], 5)
    message = str(err.value)
    assert "--max-tokens-per-gpu=5" in message
    assert "sample 1 has 9 tokens" in message
    assert "at least 9" in message


def test_invalid_budget_or_length() -> None:
    with pytest.raises(ValueError, match="--max-tokens-per-gpu must be > 0"):
        pack_by_token_budget([1], 0)
    with pytest.raises(ValueError, match="negative length"):
        pack_by_token_budget([1, -1], 4)


def test_packing_invariants_over_random_lengths() -> None:
    rng = random.Random(20261129)
    for _ in range(300):
        max_tokens = rng.randint(1, 4096)
        lengths = [rng.randint(0, max_tokens) for _ in range(rng.randint(0, 64))]
        bins = pack_by_token_budget(lengths, max_tokens)

        flat = [i for members in bins for i in members]
        assert sorted(flat) == list(range(len(lengths)))  # every index exactly once
        for members in bins:
            assert members  # no empty micro-batch
            assert members == sorted(members)  # ascending within a bin
            assert sum(lengths[i] for i in members) <= max_tokens  # budget respected
        assert [members[0] for members in bins] == sorted(members[0] for members in bins)
        # first fit leaves at most one bin at most half full (a later bin's first item did not fit into it)
        loads = [sum(lengths[i] for i in members) for members in bins]
        assert sum(1 for load in loads if 2 * load <= max_tokens) <= 1
        # no fewer bins than the volume bound, and deterministic
        assert len(bins) >= -(-sum(lengths) // max_tokens)
        assert pack_by_token_budget(list(lengths), max_tokens) == bins


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
