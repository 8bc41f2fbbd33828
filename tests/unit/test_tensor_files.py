"""Safetensors files written and read with their sha256 in the same pass."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from vime_engine.manifest import ChecksumMismatch
from vime_engine.tensor_files import join_tensors, read_tensors, split_tensors, write_tensors


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
    for name, tensor in load_file(str(path)).items():
        assert torch.equal(tensor, _tensors()[name]), name


def test_read_gives_back_every_tensor_exactly(tmp_path):
    path = tmp_path / "t.safetensors"
    entry = write_tensors(path, _tensors())
    loaded = read_tensors(path, entry)
    assert loaded.keys() == _tensors().keys()
    for name, tensor in _tensors().items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_read_refuses_a_damaged_file_naming_it(tmp_path, damage):
    path = tmp_path / "t.safetensors"
    entry = write_tensors(path, _tensors())
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) - 3] ^= 0x01
    else:
        del data[-8:]
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="t.safetensors"):
        read_tensors(path, entry)


def test_split_and_join_round_trip_a_nested_optimizer_state():
    state = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}},
             "param_groups": [{"lr": 1e-5, "params": [0], "betas": (0.9, 0.99)}], "note": "kept"}
    skeleton, tensors = split_tensors(state)
    assert set(tensors) == {"state.0.step", "state.0.exp_avg"}
    joined = join_tensors(skeleton, tensors)
    assert joined["param_groups"] == state["param_groups"] and joined["note"] == "kept"
    assert torch.equal(joined["state"][0]["exp_avg"], torch.ones(3))
