"""The two ends of the broadcast weight sync: the trainer's sender and the rollout engines' receivers.

One group per run: the sender is rank 0, the M engines of the rollout group are ranks 1..M, and every bucket is
one broadcast to all of them at once.

Wire format of one sync: a header of three int64 (version, bucket count, element count), then one flat
tensor per bucket in plan order. Both ends derive the plan from the same tensor specs and bucket size; the
header lets the receiver refuse a sender whose plan differs instead of loading garbage.

The receiver streams: buckets are received while vLLM's loader consumes the previous one's tensors, so the
extra memory is one bucket, not a second copy of the model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch

from vime_engine.weight_sync.buckets import Bucket, TensorSpec, flatten, plan_buckets, unflatten
from vime_engine.weight_sync.group import SENDER_RANK, GroupAddress, broadcast_, local_host, make_backend, open_store
from vime_engine.weight_sync.vllm_reload import reload_weights

FIRST_RECEIVER_RANK = 1
DEFAULT_TIMEOUT = timedelta(minutes=30)  # a receive may queue behind a whole rollout in async mode


def _header(version: int, plan: list[Bucket]) -> torch.Tensor:
    return torch.tensor([version, len(plan), sum(b.numel for b in plan)], dtype=torch.int64)


class BroadcastSender:
    """Rank 0 of a group with `receivers` receivers: serves the rendezvous store at construction; the group
    itself forms on the first send."""

    def __init__(
        self, backend: str, device: str, bucket_bytes: int, receivers: int = 1, timeout: timedelta = DEFAULT_TIMEOUT,
    ):
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        host = local_host()
        self._store = open_store(host, 0, SENDER_RANK, receivers + 1, timeout)
        self.address = GroupAddress(host, self._store.port, receivers + 1, backend)
        self._group = None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Broadcast every tensor; returns the bytes sent. Blocks until every receiver has taken each bucket."""
        tensors = dict(named_tensors)
        plan = plan_buckets([TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], self.bucket_bytes)
        if self._group is None:
            self._group = make_backend(self.address, self._store, SENDER_RANK, self.timeout)
        broadcast_(self._group, _header(version, plan).to(self.device))
        for bucket in plan:
            broadcast_(self._group, flatten(bucket, tensors, self.device))
        return sum(b.nbytes for b in plan)


class BroadcastReceiver:
    """Rank `rank` (1..M): joins the sender's store; `stream(version)` yields named tensors as their buckets
    arrive."""

    def __init__(
        self, address: GroupAddress, specs: list[TensorSpec], bucket_bytes: int, device: str,
        rank: int = FIRST_RECEIVER_RANK, timeout: timedelta = DEFAULT_TIMEOUT,
    ):
        if not FIRST_RECEIVER_RANK <= rank < address.world_size:
            raise ValueError(f"weight sync: receiver rank {rank} outside 1..{address.world_size - 1}")
        self.address = address
        self.rank = rank
        self.device = torch.device(device)
        self.timeout = timeout
        self.plan = plan_buckets(specs, bucket_bytes)
        self._store = None
        self._group = None

    def _connect(self) -> None:
        if self._group is None:
            self._store = open_store(self.address.host, self.address.port, self.rank, self.address.world_size,
                                     self.timeout)
            self._group = make_backend(self.address, self._store, self.rank, self.timeout)

    def stream(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        self._connect()
        header = torch.zeros(3, dtype=torch.int64, device=self.device)
        broadcast_(self._group, header)
        expected = _header(version, self.plan)
        if not torch.equal(header.cpu(), expected):
            raise RuntimeError(
                f"weight sync: sender header {header.tolist()} != expected {expected.tolist()} "
                "(version, buckets, elements): the two ends disagree on the version or the bucket plan"
            )
        for bucket in self.plan:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.device)
            broadcast_(self._group, flat)
            yield from unflatten(bucket, flat)


@contextlib.contextmanager
def paused_generation(llm) -> Iterator[None]:
    """Hold vLLM's scheduler still (requests stay queued, none stepped) for the duration of the block.

    The engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0 on every accelerator), so the engine core is
    reachable directly; "keep" mode leaves in-flight requests in place to continue under the new weights.
    """
    core = llm.llm_engine.engine_core.engine_core
    core.pause_scheduler(mode="keep", clear_cache=False)
    try:
        yield
    finally:
        core.resume_scheduler()


def load_into_engine(engine, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> float:
    """Pause → reload weights in place → reset the prefix cache → resume; bumps the version. Returns seconds.

    `engine` is a VLLMEngine. The iterator is drained even if the loader stops early: a broadcast stream
    whose remaining buckets were never received would leave the sender blocked.
    """
    start = time.perf_counter()
    llm = engine.llm
    with paused_generation(llm):
        reload_weights(llm, named_tensors)
        leftover = [name for name, _ in named_tensors]
        llm.reset_prefix_cache()  # cached KV of old weights must not serve new requests
    if leftover:
        raise RuntimeError(f"weight sync: vLLM's loader left {len(leftover)} tensors unread, e.g. {leftover[:3]}")
    engine.weight_version = version
    llm.llm_engine.set_weight_version(str(version))
    return time.perf_counter() - start
