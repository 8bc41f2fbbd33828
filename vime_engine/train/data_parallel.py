"""Data parallelism of the torch backend: which samples a rank trains on, and putting the ranks' pieces together.

Samples are dealt round-robin: rank r of N takes indices r, r+N, r+2N, … of any list it is given (a rollout or
one optimizer step), or, with `--balance-data`, an optimizer step's samples are split into equal counts with even
token totals (vime_engine.algorithms.packing.balanced_shares). Every rank holds the whole rollout, so each rank
knows every other rank's share and the length of each piece without asking; gathers only move the tensors.

Invariant: `gather_per_sample(x_r)` on every rank returns what a single rank computing all samples would have
produced, in rollout order; `sum_metrics` turns per-rank shares of a metric into the global value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from vime_engine.algorithms.packing import balanced_shares


@dataclass(frozen=True)
class DataParallel:
    rank: int = 0
    size: int = 1
    device: str = "cpu"  # where collectives' tensors live: the backend's device (gloo: cpu, nccl: cuda)

    @classmethod
    def from_default_group(cls, device: str = "cpu") -> DataParallel:
        """The trainer group's world (set up by the runtime), or a world of one outside it."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), device)
        return cls(device=device)

    def share(self, indices: list[int]) -> list[int]:
        """This rank's round-robin share of `indices`."""
        return indices[self.rank::self.size]

    def balanced_share(self, indices: list[int], lengths: list[int]) -> list[int]:
        """This rank's share of `indices` (sample i has `lengths[i]` tokens) with token totals evened out over the
        ranks (`--balance-data`)."""
        shares = balanced_shares([lengths[i] for i in indices], self.size)
        return [indices[j] for j in shares[self.rank]]

    def gather_per_sample(self, local: Tensor, lengths: list[int]) -> Tensor:
        """Flat per-token values of all samples, from each rank's flat values of its share of `range(len(lengths))`.

        `local` concatenates the pieces of samples `share(range(n))` in that order; piece i has `lengths[i]`
        entries. Returns the pieces of samples 0 … n-1 concatenated, on every rank.
        """
        if self.size == 1:
            return local
        indices = list(range(len(lengths)))
        shares = [indices[r::self.size] for r in range(self.size)]
        sizes = [sum(lengths[i] for i in share) for share in shares]
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
        padded[: local.numel()] = local
        gathered = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(gathered, padded)
        pieces: list[Tensor | None] = [None] * len(lengths)
        for share, size, flat in zip(shares, sizes, gathered):
            for i, piece in zip(share, torch.split(flat[:size], [lengths[i] for i in share])):
                pieces[i] = piece
        return torch.cat(pieces) if pieces else local

    def max_over_ranks(self, value: int) -> int:
        """The largest of the ranks' `value`s, on every rank."""
        if self.size == 1:
            return value
        largest = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        return int(largest.item())

    def sum_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric summed over ranks (every rank passes the same keys)."""
        if self.size == 1:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(values)
        return dict(zip(keys, values.tolist()))
