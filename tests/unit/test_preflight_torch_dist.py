"""Preflight of a converted torch_dist --ref-load (the Megatron trainer's initial weights in rl-pipeline): only
the Megatron backend reads one, and it must hold --hf-checkpoint's model."""

from __future__ import annotations

import shutil

import pytest

from vime_engine.config import from_flat
from vime_engine.preflight import PreflightError, preflight
from vime_engine.train.megatron_hf import HF_CONFIG_DIR, TORCH_DIST_ITERATION_DIR


@pytest.fixture
def converted_layout(tiny_model, tmp_path):
    """The layout vime_engine.convert writes (its weights are not read by preflight)."""
    converted = tmp_path / "torch_dist"
    (converted / TORCH_DIST_ITERATION_DIR).mkdir(parents=True)
    shutil.copytree(tiny_model, converted / HF_CONFIG_DIR, ignore=shutil.ignore_patterns("*.safetensors"))
    return converted


def _config(model_dir, ref_load, backend, data):
    return from_flat({"hf_checkpoint": str(model_dir), "ref_load": str(ref_load), "prompt_data": str(data),
                      "input_key": "question", "label_key": "answer", "train_backend": backend})


def test_the_torch_backend_refuses_a_converted_ref_load(tiny_model, converted_layout, arithmetic_data):
    with pytest.raises(PreflightError, match=r"--ref-load .*torch_dist.* only --train-backend megatron reads"):
        preflight(_config(tiny_model, converted_layout, "torch", arithmetic_data))


def test_a_converted_ref_load_of_another_model_is_refused(tiny_model, converted_layout, arithmetic_data, tmp_path):
    wider = tmp_path / "wider"
    shutil.copytree(tiny_model, wider)
    config = (wider / "config.json").read_text()
    assert '"intermediate_size": 256' in config
    (wider / "config.json").write_text(config.replace('"intermediate_size": 256', '"intermediate_size": 512'))
    with pytest.raises(PreflightError, match=r"holds another model than --hf-checkpoint .*ffn_hidden_size 256 vs 512"):
        preflight(_config(wider, converted_layout, "megatron", arithmetic_data))


def test_a_converted_ref_load_of_the_same_model_passes(tiny_model, converted_layout, arithmetic_data):
    preflight(_config(tiny_model, converted_layout, "megatron", arithmetic_data))
