"""The contract every training backend implements, and the factory that picks one from `--train-backend`.

The driver never calls a backend by method name: the trainer group (vime_engine/runtime/trainer_group.py)
calls these methods on every rank. Methods marked collective must run on all ranks of the trainer group at
once (they gather or reduce across ranks); rank 0's return value is the group's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from vime_engine.config import EngineConfig
from vime_engine.checkpoint.manifest import FileEntry
from vime_engine.sample import Sample

if TYPE_CHECKING:  # the driver imports the Protocol; the backends import torch
    from torch import Tensor


@runtime_checkable
class TrainBackend(Protocol):
    def train_rollout(self, samples: list[Sample]) -> dict[str, float]:
        """Collective. Advantages, then one optimizer step per global batch; metrics reduced over the group."""
        ...

    def log_probs(self, samples: list[Sample]) -> Tensor:
        """Collective. The current policy's flat per-token response log-probs of every sample (no gradient)."""
        ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Collective. The policy's full weights in HF names, `lm_head.weight` always included."""
        ...

    def save_hf(self, directory: str | Path, tokenizer_from: str | None = None) -> Path:
        """Collective. An HF directory of the current weights; rank 0 writes."""
        ...

    def save_state(self, directory: str | Path) -> dict[str, FileEntry]:
        """Collective. The resumable state; returns the digests of files hashed while writing (may be empty)."""
        ...

    def load_state(self, directory: str | Path, expected: Mapping[str, FileEntry]) -> None:
        """Collective. Load what `save_state` wrote, checking each file against the manifest's entries."""
        ...


def build_train_backend(cfg: EngineConfig, device: str) -> TrainBackend:
    """The `--train-backend`, built in the calling process (a trainer rank)."""
    if cfg.train.train_backend == "megatron":
        # Imported here: megatron-core is only installed where it runs (the CUDA / NPU images, the 3.12 lane).
        from vime_engine.train.megatron_backend import MegatronTrainBackend

        return MegatronTrainBackend(cfg, device)
    from vime_engine.train.torch_backend import TorchTrainBackend

    return TorchTrainBackend(cfg, device)
