"""How the driver moves the trainer's weights to the rollout engines: one `WeightSync` per placement.

- `InProcessSync` (colocated): each rank's actor walks the trainer's full tensors into the vLLM engine it holds.
The trainer side is the trainer group (vime_engine.runtime.trainer_group): its rank 0 is the source, the other
ranks take part in gathering the weights (collective for sharded backends).

- `ObjectStoreSync` (disaggregated): the trainer puts its state dict in Ray's object store once, every rollout
  engine fetches and loads it at the same time. Simple, works everywhere, but copies the whole model through
  shared memory (and the network across nodes) and holds a second full copy on each engine's side.
- `BroadcastSync` (disaggregated): a private process group (gloo on CPU, nccl on CUDA, hccl on Ascend) of the
  trainer's rank 0 and the M engines (ranks 1..M); the model travels in flat buckets of `bucket_mb`, each
  bucket one broadcast to every engine, device to device on accelerators, and each engine loads a bucket as
  it arrives.

Every `sync(version)` returns once every engine has loaded, with the seconds the slowest engine spent loading;
it leaves every engine at `version` (the rollout group checks that, vime_engine.runtime.rollout_group).
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
    """Colocated: every rank walks the group's full weights (a collective) into the engine in its own actor."""

    kind = "in_process"

    def __init__(self, colocated_group):
        self.actors = colocated_group.actors()

    def sync(self, version: int) -> float:
        return max(ray.get([actor.sync_weights.remote(version) for actor in self.actors]))


class ObjectStoreSync:
    kind = "object_store"

    def __init__(self, trainer_group, engines: list):
        self.trainer, self.engines = trainer_group, engines

    def sync(self, version: int) -> float:
        return self._load(self.engines, version)

    def sync_engine(self, engine, version: int) -> float:
        """Load the trainer's weights, as `version`, into one engine (a restarted one)."""
        return self._load([engine], version)

    def _load(self, engines: list, version: int) -> float:
        weights, others = self.trainer.weights_ref()  # one put, read by every engine
        seconds = ray.get([engine.update_weights.remote(weights, version) for engine in engines])
        ray.get(others)
        return max(seconds)


class BroadcastSync:
    """Set up once (store, tensor specs), then each sync is one concurrent send / receive pair."""

    kind = "broadcast"

    def __init__(
        self, trainer_group, engines: list, dist_backend: str, rollout_device: str,
        bucket_mb: float = DEFAULT_BUCKET_MB,
    ):
        self.trainer, self.engines = trainer_group, engines
        bucket_bytes = int(bucket_mb * 2**20)
        address, specs = trainer_group.open_weight_sender(dist_backend, bucket_bytes, len(engines))
        ray.get([engine.open_weight_receiver.remote(address, specs, bucket_bytes, rollout_device, rank)
                 for rank, engine in enumerate(engines, start=1)])

    def sync(self, version: int) -> float:
        # Every member must be in flight together: each blocks in the collective until all have joined.
        sent = self.trainer.send_weights(version)
        loaded = [engine.receive_weights.remote(version) for engine in self.engines]
        ray.get(sent)
        return max(ray.get(loaded))


def make_weight_sync(
    kind: str, trainer_group, engines: list, colocated: bool, dist_backend: str, rollout_device: str,
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> WeightSync:
    """The strategy for a placement; colocated runs always sync in process (there is nothing to send)."""
    if colocated:
        return InProcessSync(trainer_group)
    if kind == "object_store":
        return ObjectStoreSync(trainer_group, engines)
    if kind == "broadcast":
        return BroadcastSync(trainer_group, engines, dist_backend, rollout_device, bucket_mb)
    raise ValueError(f"--weight-sync {kind!r}: expected one of {', '.join(WEIGHT_SYNC_KINDS)}")
