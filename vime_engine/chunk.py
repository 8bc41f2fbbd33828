"""The units a pipeline schedules and retries: one resumable slice of an RL run (`run_chunk`), and the evaluation
and HF export of a checkpoint (`evaluate_checkpoint`).

The driver (and with it torch) is imported when a unit runs, not with the module: the flow side reads
ChunkResult without loading the engine.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from vime_engine.checkpoint import store as ckpt
from vime_engine.config import ConfigError, EngineConfig
from vime_engine.checkpoint.run_history import HISTORY_FILE, saved_records


class ChunkResult(BaseModel):
    """A chunk's end checkpoint, its rollout range, the checkpoint's manifest hash and the last rollout's metrics."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    checkpoint_path: str
    first_rollout: int
    last_rollout: int  # inclusive
    manifest_sha256: str
    config_hash: str
    metrics: dict[str, Any]  # the last rollout's metrics


def run_chunk(config: EngineConfig, start_rollout_id: int, num_rollouts: int) -> ChunkResult:
    """Train rollouts `start_rollout_id … start_rollout_id + num_rollouts - 1` and checkpoint the end.

    Starts from the newest valid checkpoint under `--save` (so a chunk killed midway continues from its last
    in-chunk checkpoint) or, when there is none, from `--load` or the initial HF model. A chunk that is
    already complete returns its checkpoint without training.
    """
    if config.checkpoint.save is None:
        raise ConfigError("run_chunk needs --save DIR: a chunk hands its result over as a checkpoint")
    end = start_rollout_id + num_rollouts
    if end > config.rollout.num_rollout:
        raise ConfigError(
            f"chunk {start_rollout_id}..{end - 1} runs past --num-rollout {config.rollout.num_rollout}"
        )
    # How far the run got; the files' hashes are checked when the run loads them.
    found = (ckpt.find_latest(config.checkpoint.save, content=False)
             or ckpt.find_latest(config.checkpoint.load, content=False))
    done_until = found.rollout_id + 1 if found is not None else 0
    if done_until < start_rollout_id:
        raise ConfigError(
            f"chunk starts at rollout {start_rollout_id} but the newest checkpoint "
            f"({found.path if found else 'none'}) ends at rollout {done_until - 1}: run the earlier chunks first"
        )
    if done_until < end:
        from vime_engine.runtime.driver import train

        train(config, end_rollout_id=end)
    # Also for a chunk finished earlier: its own end checkpoint, even if later chunks have run since.
    found = ckpt.validate(ckpt.checkpoint_dir(config.checkpoint.save, end - 1))
    state = found.driver_state()
    history_file = found.path.parent / HISTORY_FILE
    history = saved_records(state, history_file.read_bytes, str(history_file))
    last = next((h for h in reversed(history) if h["rollout_id"] == end - 1), {})
    return ChunkResult(
        checkpoint_path=str(found.path), first_rollout=start_rollout_id, last_rollout=end - 1,
        manifest_sha256=found.manifest_hash, config_hash=state["config_hash"], metrics=last,
    )


def evaluate_checkpoint(config: EngineConfig) -> dict[str, float]:
    """Evaluate the weights `--load` names (or the initial HF model) on the eval sets and export them to
    `--save-hf` when given; the eval sets' metrics.

    The driver's run without rollouts: it loads, pushes the weights to the rollout engine, evaluates, exports.
    A config that would train is refused, so an evaluation never moves a checkpoint on. An export alone of a torch
    trainer of one rank on CPU needs neither Ray nor an engine (`export_in_process`).
    """
    if config.rollout.num_rollout != 0:
        raise ConfigError(f"evaluate_checkpoint trains nothing: --num-rollout must be 0, not "
                          f"{config.rollout.num_rollout}")
    if exports_in_process(config):
        export_in_process(config)
        return {}
    from vime_engine.runtime.driver import train

    return train(config).eval_metrics


def exports_in_process(config: EngineConfig) -> bool:
    """Whether `config` asks for an HF export and nothing else that needs the run's workers: no eval sets, the torch
    backend's one rank on this machine's CPU (the pipeline's evaluate stage on the embedded default)."""
    from vime_engine.devices.accelerator import resolve_accelerator

    return (config.checkpoint.save_hf is not None and not config.eval_datasets
            and config.train.train_backend in ("torch", "fsdp") and config.trainer_world_size == 1
            and config.placement.ray_address is None and resolve_accelerator(config.placement.device).kind == "cpu")


def export_in_process(config: EngineConfig) -> None:
    """The torch trainer's `save_hf` of the weights of the newest checkpoint under `--load` (the initial weights
    without one), built in this process: the files the driver's run writes, without the 20-30 s of starting Ray, the
    trainer's actor and a vLLM engine that an export never uses, nor reading the optimizer's state. The weights'
    checksum is checked as they load, as a resume checks it."""
    from vime_engine.checkpoint.finite import NonFiniteCheckpoint
    from vime_engine.checkpoint.manifest import ChecksumMismatch
    from vime_engine.preflight import check_inputs
    from vime_engine.train.torch_backend import TorchTrainBackend

    check_inputs(config)
    backend = TorchTrainBackend(config, "cpu")
    found = ckpt.find_latest(config.checkpoint.load, content=False)
    if found is not None:
        try:
            backend.load_weights(found.path, found.manifest.files)
        except (ChecksumMismatch, NonFiniteCheckpoint) as exc:
            raise ckpt.CheckpointError(f"{found.path}: {exc}") from None
    backend.save_hf(config.checkpoint.save_hf)
