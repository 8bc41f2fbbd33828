"""An export alone (`evaluate_checkpoint` with --save-hf and no eval sets: the pipeline's evaluate stage) is written in
the job's own process, from the checkpoint's weights, and holds what the trainer rank's export after a resume holds,
byte for byte (what the driver's run wrote before: load the whole state, then `save_hf`). On the real demo's last
checkpoint the two were compared the same way (SmolLM2-135M, 6 files identical)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vime_engine.checkpoint import store as ckpt
from vime_engine.chunk import evaluate_checkpoint, exports_in_process
from vime_engine.config import from_flat
from vime_engine.train.torch_backend import TorchTrainBackend


def _config(tiny_model: Path, arithmetic_data: Path, **flags) -> object:
    return from_flat({"hf-checkpoint": str(tiny_model), "prompt-data": str(arithmetic_data),
                      "input-key": "question", "label-key": "answer", "num-rollout": 0, "lr": 1e-3, **flags})


@pytest.fixture(scope="module")
def trained_checkpoint(tiny_model, arithmetic_data, tmp_path_factory) -> Path:
    """A checkpoint of weights one Adam step away from the initial ones (the optimizer's moments in it too)."""
    root = tmp_path_factory.mktemp("export") / "ckpt"
    backend = TorchTrainBackend(_config(tiny_model, arithmetic_data))
    for p in backend.model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    backend.optimizer.step()
    staged = ckpt.staging_dir(root, 0)
    written = backend.save_state(str(staged))
    ckpt.commit(root, staged, 0, {"rollout_id": 0}, keep_last=None, written=written)
    return root


def test_the_export_equals_the_trainers_export_after_a_resume_byte_for_byte(tiny_model, arithmetic_data,
                                                                             trained_checkpoint, tmp_path):
    config = _config(tiny_model, arithmetic_data, load=str(trained_checkpoint), **{"save-hf": str(tmp_path / "ours")})
    assert exports_in_process(config)
    assert evaluate_checkpoint(config) == {}

    resumed = TorchTrainBackend(config)  # what the trainer rank did: the whole state, then the export
    found = ckpt.find_latest(trained_checkpoint)
    resumed.load_state(found.path, found.manifest.files)
    resumed.save_hf(tmp_path / "theirs")
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    assert [p.name for p in theirs.iterdir() if p.read_bytes() != (ours / p.name).read_bytes()] == []
    # ... and it is the trained checkpoint, not the initial weights.
    initial = (tiny_model / "model.safetensors").read_bytes()
    assert (ours / "model.safetensors").read_bytes() != initial


def test_what_needs_the_run_workers_still_goes_through_them(tiny_model, arithmetic_data, tmp_path):
    base = {"save-hf": str(tmp_path / "hf")}
    assert not exports_in_process(_config(tiny_model, arithmetic_data))  # nothing to export
    assert not exports_in_process(_config(tiny_model, arithmetic_data, **base, **{
        "eval-prompt-data": ["aime", "builtin://aime-synthetic"]}))  # an evaluation needs the engine
    assert not exports_in_process(_config(tiny_model, arithmetic_data, **base, **{"actor-num-gpus-per-node": 2}))
    assert not exports_in_process(_config(tiny_model, arithmetic_data, **base, **{"ray-address": "ray://h:10001"}))


def test_a_corrupt_checkpoint_is_refused_naming_it(tiny_model, arithmetic_data, trained_checkpoint, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(trained_checkpoint, copy)
    weights = copy / "rollout_0000000" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    config = _config(tiny_model, arithmetic_data, load=str(copy), **{"save-hf": str(tmp_path / "hf")})
    with pytest.raises(ckpt.CheckpointError, match="rollout_0000000"):
        evaluate_checkpoint(config)
    assert not (tmp_path / "hf").exists()
