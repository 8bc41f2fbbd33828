"""The stages before training, as Prefect tasks: check the image, stage model and data, convert the model.

Thin wrappers: the work is in tasks.images, tasks.staging and (for Megatron) vime_engine.convert. Staging is
idempotent by content (an already staged asset is not transferred again), so these tasks need no cache.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from prefect import get_run_logger, task

from tasks import images, staging
from tasks.staging import StagedAsset


@task(name="check_image", retries=2, retry_delay_seconds=5)
def check_image(reference: str, requirements: images.ImageRequirements) -> images.ImageInfo:
    """The image exists, its platform and labels match: fail before anything is downloaded."""
    info = images.check_image(reference, requirements)
    get_run_logger().info("image %s → %s (%s)", reference, info.digest, info.platform)
    return info


@task(name="stage_model", retries=2, retry_delay_seconds=5)
def stage_model(source: str, storage_root: str) -> StagedAsset:
    asset = staging.stage_model(source, storage_root)
    get_run_logger().info("model %s staged at %s (%s)", source, asset.uri,
                          "uploaded" if asset.uploaded else "already there")
    return asset


@task(name="stage_data", retries=2, retry_delay_seconds=5)
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


@task(name="convert_checkpoint")
def convert_checkpoint(model: StagedAsset, train_backend: str, storage_root: str) -> TrainableModel:
    """HF → the backend's format. The torch backend trains HF weights as they are (GGUF sources such as the
    built-in SmolLM2 were already dequantised to HF safetensors by staging); Megatron needs torch_dist."""
    if train_backend == "torch":
        return TrainableModel(model.uri, model.manifest_hash, "torch", model)
    if train_backend == "megatron":
        if importlib.util.find_spec("vime_engine.convert") is None:
            raise RuntimeError(
                "--train-backend megatron needs the HF → Megatron conversion (vime_engine.convert), which this "
                "build does not have yet; train with --train-backend torch")
        from vime_engine import convert  # provided by the Megatron backend work

        uri, manifest_hash = convert.hf_to_megatron(model.uri, storage_root)
        return TrainableModel(uri, manifest_hash, "megatron", model)
    raise ValueError(f"unknown train backend {train_backend!r}")
