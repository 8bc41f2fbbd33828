"""How the driver moves the trainer's weights to the rollout engine: one `WeightSync` per placement.

- `InProcessSync` (colocated): the actor holding both walks the trainer's tensors into vLLM.
The trainer side is the trainer group (vime_engine.runtime.trainer_group): its rank 0 is the source, the other
ranks take part in gathering the weights (collective for sharded backends).

- `ObjectStoreSync` (disaggregated): the trainer puts its state dict in Ray's object store, the rollout
  actor fetches and loads it. Simple, works everywhere, but copies the whole model through shared memory
  (and the network across nodes) and holds a second full copy on the rollout side.
- `BroadcastSync` (disaggregated): a private two-rank process group (gloo on CPU, nccl on CUDA, hccl on
  Ascend) between the trainer and the rollout actor; the model travels in flat buckets of `bucket_mb`,
  device to device on accelerators, and the receiver loads each bucket as it arrives.

Every `sync(version)` returns the seconds the rollout side spent loading and leaves the engine at `version`.
"""

from __future__ import annotations

from typing import Literal, Protocol

import ray

WeightSyncKind = Literal["object_store", "broadcast"]
WEIGHT_SYNC_KINDS: tuple[str, ...] = ("object_store", "broadcast")
DEFAULT_BUCKET_MB = 64


class WeightSync(Protocol):
    kind: str

    def sync(self, version: int) -> float: ...


class InProcessSync:
    kind = "in_process"

    def __init__(self, colocated_group):
        self.actor = colocated_group.leader

    def sync(self, version: int) -> float:
        return ray.get(self.actor.sync_weights.remote(version))


class ObjectStoreSync:
    kind = "object_store"

    def __init__(self, trainer_group, rollout):
        self.trainer, self.rollout = trainer_group, rollout

    def sync(self, version: int) -> float:
        weights, others = self.trainer.weights_ref()
        seconds = ray.get(self.rollout.update_weights.remote(weights, version))
        ray.get(others)
        return seconds


class BroadcastSync:
    """Set up once (store, tensor specs), then each sync is one concurrent send / receive pair."""

    kind = "broadcast"

    def __init__(
        self, trainer_group, rollout, dist_backend: str, rollout_device: str, bucket_mb: float = DEFAULT_BUCKET_MB,
    ):
        self.trainer, self.rollout = trainer_group, rollout
        bucket_bytes = int(bucket_mb * 2**20)
        address, specs = trainer_group.open_weight_sender(dist_backend, bucket_bytes)
        ray.get(rollout.open_weight_receiver.remote(address, specs, bucket_bytes, rollout_device))

    def sync(self, version: int) -> float:
        # Both sides must be in flight together: each blocks in the collective until the other joins.
        sent = self.trainer.send_weights(version)
        loaded = self.rollout.receive_weights.remote(version)
        *_, seconds = ray.get([*sent, loaded])
        return seconds


def make_weight_sync(
    kind: str, trainer_group, rollout, colocated: bool, dist_backend: str, rollout_device: str,
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> WeightSync:
    """The strategy for a placement; colocated runs always sync in process (there is nothing to send)."""
    if colocated:
        return InProcessSync(trainer_group)
    if kind == "object_store":
        return ObjectStoreSync(trainer_group, rollout)
    if kind == "broadcast":
        return BroadcastSync(trainer_group, rollout, dist_backend, rollout_device, bucket_mb)
    raise ValueError(f"--weight-sync {kind!r}: expected one of {', '.join(WEIGHT_SYNC_KINDS)}")
