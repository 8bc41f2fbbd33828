"""Splitting a batch of samples into micro-batches (`--micro-batch-size`, `--use-dynamic-batch-size`)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_shares", "fixed_size_micro_batches", "pack_by_padded_length", "shared_prompt_rows"]


def pack_by_padded_length(lengths: Sequence[int], max_tokens: int, fixed_cost: float,
                          pair_cost: float = 0.0) -> list[list[int]]:
    """Group sample indices into micro-batches for a forward that pads every row to the micro-batch's longest.

    A micro-batch of `rows` samples whose longest has `L` tokens computes `rows` rows of `L` tokens, padding
    included: it costs `rows * (L + pair_cost * L**2) + fixed_cost`, in tokens of work (`pair_cost`: a query-key
    pair's attention against a token's work; `fixed_cost`: what a micro-batch costs whatever its size, the host's
    dispatch of its forward and backward). The result is the cheapest partition into runs of the samples ordered
    longest first (ties by lower index) whose padded sizes `rows * L` fit `max_tokens` (`--max-tokens-per-gpu`; a
    single sample always fits), by dynamic programming over the run ends; among equally cheap ones, the one with
    fewer micro-batches. No partition is cheaper: where a micro-batch holds a shorter sample than another one
    whose longest is no longer, swapping the two keeps both sizes and lengthens neither's rows, so swaps turn any
    partition into runs of that order at no more cost. Deterministic: the result depends only on the arguments.

    Invariants of the result: every index of `lengths` appears exactly once; each micro-batch's padded size is
    <= max_tokens; indices within a micro-batch are ascending; micro-batches are ordered by their smallest index;
    no micro-batch is empty; with `fixed_cost` 0, only samples of equal length share a micro-batch. An empty
    `lengths` gives [].

    Raises ValueError when a single sample is longer than `max_tokens` (no split could hold it).
    """
    if max_tokens <= 0:
        raise ValueError(f"--max-tokens-per-gpu must be > 0, got {max_tokens}")
    if fixed_cost < 0 or pair_cost < 0:
        raise ValueError(f"fixed_cost and pair_cost must be >= 0, got {fixed_cost} and {pair_cost}")
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"sample {index} has a negative length {length}")
        if length > max_tokens:
            raise ValueError(
                f"sample {index} has {length} tokens, more than --max-tokens-per-gpu={max_tokens}; "
                f"set --max-tokens-per-gpu to at least {max(lengths)}"
            )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    # best[j]: (cost, micro-batches) of the cheapest packing of order[:j]; start[j]: where its last run begins.
    best: list[tuple[float, int]] = [(0.0, 0)]
    start: list[int] = [0]
    for end in range(1, len(order) + 1):
        candidates = []
        for first in range(end - 1, -1, -1):
            rows, longest = end - first, lengths[order[first]]
            if rows > 1 and rows * longest > max_tokens:
                break  # earlier starts only add rows, each at least as long
            cost, count = best[first]
            candidates.append(((cost + rows * (longest + pair_cost * longest * longest) + fixed_cost, count + 1),
                               first))
        chosen, first = min(candidates)
        best.append(chosen)
        start.append(first)
    bins: list[list[int]] = []
    end = len(order)
    while end > 0:
        bins.append(sorted(order[start[end]:end]))
        end = start[end]
    return sorted(bins)


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


def split_to_count(micro_batches: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """`micro_batches` made exactly `count` (sharded data parallel runs each forward and backward as a collective,
    so every rank needs the same number): the micro-batch with the most samples is halved while one holds two or
    more, then empty micro-batches make up the rest. A half holds a subset of its micro-batch's samples, so it
    fits any token budget the whole did.

    Invariants: every index stays, in its order; no micro-batch grows.
    """
    out = [list(mb) for mb in micro_batches]
    if count < len(out):
        raise ValueError(f"cannot make {len(out)} micro-batches into {count}")
    while len(out) < count:
        largest = max(range(len(out)), key=lambda i: len(out[i]), default=None)
        if largest is None or len(out[largest]) < 2:
            break
        mb = out.pop(largest)
        half = (len(mb) + 1) // 2
        out[largest:largest] = [mb[:half], mb[half:]]
    return out + [[] for _ in range(count - len(out))]


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


def shared_row_tokens(prompt_length: int, response_lengths: Sequence[int], row: Sequence[int]) -> int:
    """Tokens of a forward row holding one prompt and the responses of the samples `row` indexes."""
    return prompt_length + sum(response_lengths[i] for i in row)


def shared_prompt_rows(prompts: Sequence[Sequence[int]], response_lengths: Sequence[int], pair_cost: float,
                       max_tokens: int) -> list[list[int]]:
    """Group sample indices into forward rows where samples with the same prompt share it: a row holds one prompt
    followed by the responses of one or more samples, each response attending to the prompt and to itself. The n
    samples of a GRPO group then run their prompt once instead of n times.

    Sharing is not free: a row of L tokens attends over all L x L pairs (the masked-out pairs between responses
    included), against a token's cost of 1 that is `pair_cost` per pair. Each group of samples with the same
    prompt tokens is split into the number of rows, 1 to its size, whose cost sum(L + pair_cost * L**2) is
    least, among the splits whose rows fit `max_tokens` (a single sample always may; fewer rows on ties); a split
    into k rows gives each as even a share of the response tokens as `balanced_shares` makes. Deterministic:
    depends only on the arguments.

    Invariants: every index appears in exactly one row; the samples of a row have the same prompt tokens; a row
    of several samples has at most `max_tokens` tokens; indices within a row are ascending; rows are ordered by
    their smallest index.
    """
    if len(prompts) != len(response_lengths):
        raise ValueError(f"{len(prompts)} prompts but {len(response_lengths)} response lengths")
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(index)

    rows: list[list[int]] = []
    for prompt, members in groups.items():
        best: tuple[float, list[list[int]]] | None = None
        for count in range(1, len(members) + 1):
            shares = balanced_shares([response_lengths[i] for i in members], count)
            split = [[members[j] for j in share] for share in shares]
            lengths = [shared_row_tokens(len(prompt), response_lengths, row) for row in split]
            if count < len(members) and max(lengths) > max_tokens:
                continue
            cost = sum(length + pair_cost * length * length for length in lengths)
            if best is None or cost < best[0]:
                best = (cost, split)
        assert best is not None  # one sample per row always qualifies
        rows.extend(best[1])
    return sorted(rows)
