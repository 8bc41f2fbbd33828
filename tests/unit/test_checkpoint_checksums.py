"""Checkpoint manifests: sha256 (the content address) and xxh3-128 (what a load checks), old manifests included."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch
import xxhash

from vime_engine.checkpoint import store as ckpt
from vime_engine.checkpoint.manifest import MANIFEST_NAME, ChecksumMismatch, Manifest
from vime_engine.checkpoint.tensor_files import read_tensors, write_tensors


def _save(root, rollout_id: int) -> ckpt.CheckpointRef:
    staged = ckpt.staging_dir(root, rollout_id)
    written = {"model.safetensors": write_tensors(staged / "model.safetensors", {"w": torch.full((64, 8), rollout_id)})}
    (staged / "buffer.pkl").write_bytes(b"carried samples %d" % rollout_id)
    return ckpt.commit(root, staged, rollout_id, {"rollout_id": rollout_id}, keep_last=None, written=written)


def _as_old_manifest(path) -> None:
    """Rewrite a checkpoint's manifest as one written before the fast checksum existed."""
    doc = json.loads((path / MANIFEST_NAME).read_text())
    for entry in doc["files"].values():
        del entry["xxh3_128"]
    (path / MANIFEST_NAME).write_text(json.dumps(doc))


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_file_of_a_checkpoint_gets_both_checksums(tmp_path):
    ref = _save(tmp_path, 1)
    assert set(ref.manifest.files) == {"model.safetensors", "buffer.pkl", ckpt.DRIVER_STATE}
    for rel, entry in ref.manifest.files.items():
        data = (ref.path / rel).read_bytes()
        assert entry.sha256 == hashlib.sha256(data).hexdigest(), rel
        assert entry.xxh3_128 == xxhash.xxh3_128(data).hexdigest(), rel
    assert Manifest.from_bytes((ref.path / MANIFEST_NAME).read_bytes()) == ref.manifest


@pytest.mark.parametrize("old_manifest", [False, True], ids=["xxh3", "sha256-only"])
def test_a_clean_checkpoint_loads(tmp_path, old_manifest):
    ref = _save(tmp_path, 1)
    if old_manifest:
        _as_old_manifest(ref.path)
    found = ckpt.find_latest(tmp_path)
    assert found is not None and found.rollout_id == 1
    assert (found.manifest.files["buffer.pkl"].xxh3_128 is None) == old_manifest
    assert found.read_verified("buffer.pkl") == b"carried samples 1"
    assert found.driver_state() == {"rollout_id": 1}
    weights = read_tensors(found.path / "model.safetensors", found.manifest.files["model.safetensors"])
    assert torch.equal(weights["w"], torch.full((64, 8), 1))


@pytest.mark.parametrize("old_manifest", [False, True], ids=["xxh3", "sha256-only"])
@pytest.mark.parametrize("damaged", ["model.safetensors", "buffer.pkl"])
def test_a_flipped_byte_skips_the_checkpoint_for_the_previous_one(tmp_path, caplog, damaged, old_manifest):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    if old_manifest:
        _as_old_manifest(newest.path)
    _flip_a_byte(newest.path / damaged)
    with caplog.at_level(logging.WARNING):
        found = ckpt.find_latest(tmp_path)
    assert found is not None and found.rollout_id == 1
    assert "rollout_0000002" in caplog.text and damaged in caplog.text
    # The resume path checks sizes first and each file's checksum as it reads it: the same file is refused.
    unchecked = next(ckpt.candidates(tmp_path, content=False))
    assert unchecked.rollout_id == 2
    if damaged == "buffer.pkl":
        with pytest.raises(ckpt.CheckpointError, match=damaged):
            unchecked.read_verified(damaged)
    else:
        with pytest.raises(ChecksumMismatch, match=damaged):
            read_tensors(unchecked.path / damaged, unchecked.manifest.files[damaged])


def test_a_malformed_fast_checksum_makes_the_manifest_unreadable(tmp_path):
    ref = _save(tmp_path, 1)
    doc = json.loads((ref.path / MANIFEST_NAME).read_text())
    doc["files"]["buffer.pkl"]["xxh3_128"] = "not hex"
    (ref.path / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(ckpt.CheckpointError, match="buffer.pkl"):
        ckpt.validate(ref.path)
