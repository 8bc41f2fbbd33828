"""Splitting a batch of samples into micro-batches (`--micro-batch-size`, `--use-dynamic-batch-size`)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_shares", "fixed_size_micro_batches", "pack_by_token_budget"]


def pack_by_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices into micro-batches of at most `max_tokens` tokens (`--max-tokens-per-gpu`).

    Algorithm: first-fit decreasing. Samples are visited longest first (ties by lower index) and each goes
    into the first micro-batch, in order of creation, that still has room; a new micro-batch is opened
    when none has. This uses at most 11/9 * OPT + 6/9 micro-batches. Deterministic: the result depends only
    on `lengths` and `max_tokens`.

    Invariants of the result: every index of `lengths` appears exactly once; each micro-batch's total
    length is <= max_tokens; indices within a micro-batch are ascending; micro-batches are ordered by
    their smallest index; no micro-batch is empty. An empty `lengths` gives [].

    Raises ValueError when a single sample is longer than `max_tokens` (no split could hold it).
    """
    if max_tokens <= 0:
        raise ValueError(f"--max-tokens-per-gpu must be > 0, got {max_tokens}")
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"sample {index} has a negative length {length}")
        if length > max_tokens:
            raise ValueError(
                f"sample {index} has {length} tokens, more than --max-tokens-per-gpu={max_tokens}; "
                f"set --max-tokens-per-gpu to at least {max(lengths)}"
            )
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b, free in enumerate(room) if free >= lengths[index]), None)
        if target is None:
            bins.append([])
            room.append(max_tokens)
            target = len(bins) - 1
        bins[target].append(index)
        room[target] -= lengths[index]
    return sorted(sorted(members) for members in bins)


def fixed_size_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive runs of `micro_batch_size` indices (`--micro-batch-size`); the last may be shorter.

    Invariants: every index in range(num_samples) appears exactly once, in order; all micro-batches but
    the last have exactly micro_batch_size indices.
    """
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    return [list(range(start, min(start + micro_batch_size, num_samples)))
            for start in range(0, num_samples, micro_batch_size)]


def balanced_shares(lengths: Sequence[int], num_shares: int) -> list[list[int]]:
    """Split sample indices into `num_shares` shares of equal count with totals of tokens as even as the counts
    allow (`--balance-data`: each data-parallel rank's share of an optimizer step).

    Algorithm: samples longest first (ties by lower index) go to the share with the fewest tokens so far among
    those not yet full (ties by lower share index); the first n % num_shares shares hold one sample more than the
    others when num_shares does not divide n. Deterministic: depends only on the inputs.

    Invariants: every index appears in exactly one share; share sizes differ by at most one (shares with lower
    index are not smaller); indices within a share are ascending.
    """
    if num_shares < 1:
        raise ValueError(f"num_shares must be >= 1, got {num_shares}")
    n = len(lengths)
    capacity = [n // num_shares + (1 if r < n % num_shares else 0) for r in range(num_shares)]
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    tokens = [0] * num_shares
    for index in sorted(range(n), key=lambda i: (-lengths[i], i)):
        target = min((r for r in range(num_shares) if len(shares[r]) < capacity[r]), key=lambda r: (tokens[r], r))
        shares[target].append(index)
        tokens[target] += lengths[index]
    return [sorted(share) for share in shares]
