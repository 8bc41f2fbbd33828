"""The stages before training, as Prefect tasks: check the image, stage model and data, convert the model.

Thin wrappers: the work is in tasks.images, tasks.staging and (for Megatron) vime_engine.convert. Staging is
idempotent by content (an already staged asset is not transferred again), so these tasks need no cache.
They retry only what another attempt can fix (a storage 5xx or dropped connection, an unreachable registry):
a missing source, a refused credential or a wrong image fails at once, as itself.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task

from tasks import images, staging
from tasks.retry_policy import retry_on
from tasks.staging import StagedAsset
from tasks.storage import TransientStorageError, open_storage
from vime_engine.preflight import require_megatron, require_megatron_bridge


@task(name="check_image", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_on(images.RegistryError))
def check_image(reference: str, requirements: images.ImageRequirements) -> images.ImageInfo:
    """The image exists, its platform and labels match: fail before anything is downloaded."""
    info = images.check_image(reference, requirements)
    get_run_logger().info("image %s → %s (%s)", reference, info.digest, info.platform)
    return info


@task(name="stage_model", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_on(TransientStorageError))
def stage_model(source: str, storage_root: str) -> StagedAsset:
    asset = staging.stage_model(source, storage_root)
    get_run_logger().info("model %s staged at %s (%s)", source, asset.uri,
                          "uploaded" if asset.uploaded else "already there")
    return asset


@task(name="stage_data", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_on(TransientStorageError))
def stage_data(source: str, storage_root: str) -> StagedAsset:
    asset = staging.stage_dataset(source, storage_root)
    get_run_logger().info("dataset %s staged at %s (%s)", source, asset.uri,
                          "uploaded" if asset.uploaded else "already there")
    return asset


@dataclass(frozen=True)
class TrainableModel:
    """The model in the format the training backend loads, and where it came from."""

    uri: str
    manifest_hash: str
    backend: str
    staged: StagedAsset

    @property
    def converted(self) -> bool:
        """Whether the trainer starts from a converted checkpoint rather than the staged HF model."""
        return self.uri != self.staged.uri


@task(name="convert_checkpoint")
def convert_checkpoint(model: StagedAsset, train_backend: str, storage_root: str, convert: bool = True,
                       megatron_to_hf_mode: str = "raw") -> TrainableModel:
    """HF → the backend's format. The torch and fsdp backends train HF weights as they are (GGUF sources such as
    the built-in SmolLM2 were already dequantised to HF safetensors by staging). Megatron starts from a torch_dist
    checkpoint converted once and verified by a round trip, or with `convert` off, reads the HF weights itself
    in every chunk that starts without a checkpoint; either way through the engine's `--megatron-to-hf-mode`
    (raw: its own mapping; bridge: Megatron-Bridge)."""
    if train_backend in ("torch", "fsdp"):
        return TrainableModel(model.uri, model.manifest_hash, train_backend, model)
    if train_backend == "megatron":
        _require_packages(megatron_to_hf_mode)  # the install hint, before anything is fetched
        if not convert:
            return TrainableModel(model.uri, model.manifest_hash, "megatron", model)
        return TrainableModel(*_hf_to_megatron(model, storage_root, megatron_to_hf_mode), "megatron", model)
    raise ValueError(f"unknown train backend {train_backend!r}")


def _require_packages(megatron_to_hf_mode: str) -> None:
    require_megatron()
    if megatron_to_hf_mode == "bridge":
        require_megatron_bridge()


def _hf_to_megatron(model: StagedAsset, storage_root: str, mode: str) -> tuple[str, str]:
    """Convert the staged HF model to torch_dist (verified by a round trip) and commit it beside the source."""
    from vime_engine.convert import convert_checkpoint as convert
    from vime_engine.devices.accelerator import resolve_accelerator

    # Each mode's conversion under its own name: the files of the two differ in conversion.json.
    suffix = "-megatron" if mode == "raw" else f"-megatron-{mode}"
    prefix = model.uri.removeprefix(storage_root.rstrip("/") + "/").rstrip("/") + suffix
    with tempfile.TemporaryDirectory(prefix="vimeflow-convert-") as tmp:
        hf_dir = staging.fetch(model.uri, Path(tmp) / "hf")
        result = convert(hf_dir, Path(tmp) / "megatron", "hf_to_megatron", resolve_accelerator(), mode=mode)
        get_run_logger().info("HF → Megatron: max log-prob diff %.2e", result.max_logprob_abs_diff)
        manifest = open_storage(storage_root).commit_tree(Path(tmp) / "megatron", prefix)
    return open_storage(storage_root).uri(prefix), manifest.hash
