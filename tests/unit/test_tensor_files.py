"""Safetensors files written and read with their checksums in the same pass."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from vime_engine.checkpoint.manifest import ChecksumMismatch
from vime_engine.checkpoint.tensor_files import join_tensors, read_tensors, split_tensors, write_tensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "half": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # odd byte count before wider dtypes
        "weight": torch.randn(40, 7, generator=g),
        "step": torch.tensor(3.0),
        "ids": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "transposed": torch.randn(4, 6, generator=g).t(),  # non-contiguous
    }


def test_write_returns_the_files_digest_and_any_safetensors_reader_loads_it(tmp_path):
    path = tmp_path / "t.safetensors"
    entry = write_tensors(path, _tensors(), {"format": "pt"})
    data = path.read_bytes()
    assert entry.size == len(data) and entry.sha256 == hashlib.sha256(data).hexdigest()
    assert entry.xxh3_128 == xxhash.xxh3_128(data).hexdigest()
    for name, tensor in load_file(str(path)).items():
        assert torch.equal(tensor, _tensors()[name]), name


def test_read_gives_back_every_tensor_exactly(tmp_path):
    path = tmp_path / "t.safetensors"
    entry = write_tensors(path, _tensors())
    loaded = read_tensors(path, entry)
    assert loaded.keys() == _tensors().keys()
    for name, tensor in _tensors().items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("old_manifest", [False, True], ids=["xxh3", "sha256-only"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_read_refuses_a_damaged_file_naming_it(tmp_path, damage, old_manifest):
    path = tmp_path / "t.safetensors"
    entry = write_tensors(path, _tensors())
    if old_manifest:  # an entry from before the fast checksum: the sha256 is checked instead
        entry = dataclasses.replace(entry, xxh3_128=None)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) - 3] ^= 0x01
    else:
        del data[-8:]
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="t.safetensors"):
        read_tensors(path, entry)


def test_read_checks_the_fast_checksum_when_recorded_and_the_sha256_otherwise(tmp_path):
    path = tmp_path / "t.safetensors"
    entry = write_tensors(path, _tensors())
    wrong_sha = dataclasses.replace(entry, sha256="0" * 64)
    assert read_tensors(path, wrong_sha).keys() == _tensors().keys()  # the sha256 is not read again at load
    with pytest.raises(ChecksumMismatch, match="xxh3_128"):
        read_tensors(path, dataclasses.replace(entry, xxh3_128="0" * 32))
    assert read_tensors(path, dataclasses.replace(entry, xxh3_128=None)).keys() == _tensors().keys()
    with pytest.raises(ChecksumMismatch, match="sha256"):
        read_tensors(path, dataclasses.replace(wrong_sha, xxh3_128=None))


def test_split_and_join_round_trip_a_nested_optimizer_state():
    state = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}},
             "param_groups": [{"lr": 1e-5, "params": [0], "betas": (0.9, 0.99)}], "note": "kept"}
    skeleton, tensors = split_tensors(state)
    assert set(tensors) == {"state.0.step", "state.0.exp_avg"}
    joined = join_tensors(skeleton, tensors)
    assert joined["param_groups"] == state["param_groups"] and joined["note"] == "kept"
    assert torch.equal(joined["state"][0]["exp_avg"], torch.ones(3))
