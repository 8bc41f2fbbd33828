"""Packing named tensors into flat buckets for a collective transfer.

Invariants: a bucket holds tensors of one dtype (a flat tensor has one dtype), in the order they were given;
a bucket never exceeds `bucket_bytes` unless a single tensor is larger, in which case it travels alone; the
plan depends only on names, shapes and dtypes, so both ends derive the same plan from the same specs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the driver plans from specs and never holds a tensor
    import torch


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    dtype: torch.dtype
    specs: tuple[TensorSpec, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def specs_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in named_tensors]


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Greedy, order-preserving: one open bucket per dtype, closed when the next tensor would overflow it."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    buckets: list[Bucket] = []
    open_by_dtype: dict[torch.dtype, list[TensorSpec]] = {}
    for spec in specs:
        current = open_by_dtype.setdefault(spec.dtype, [])
        if current and sum(s.nbytes for s in current) + spec.nbytes > bucket_bytes:
            buckets.append(Bucket(spec.dtype, tuple(current)))
            current = open_by_dtype[spec.dtype] = []
        current.append(spec)
    buckets.extend(Bucket(dtype, tuple(current)) for dtype, current in open_by_dtype.items() if current)
    return buckets


def flatten(bucket: Bucket, tensors: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """One contiguous tensor holding the bucket's tensors back to back, in plan order."""
    import torch

    return torch.cat([tensors[s.name].detach().reshape(-1).to(device=device, dtype=bucket.dtype)
                      for s in bucket.specs])


def unflatten(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views into `flat`, one per spec; the caller must not reuse `flat` while the views are alive."""
    offset = 0
    for spec in bucket.specs:
        yield spec.name, flat[offset: offset + spec.numel].view(spec.shape)
        offset += spec.numel
