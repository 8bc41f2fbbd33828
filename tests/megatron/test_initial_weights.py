"""The Megatron trainer's initial weights: a converted torch_dist --ref-load (what rl-pipeline hands it) is what it
trains from, while --hf-checkpoint stays the HF model that the tokenizer, vLLM and the HF export read.

The HF model handed as --hf-checkpoint has the converted model's architecture but other weights, so a trainer
that loaded --hf-checkpoint instead of the converted checkpoint is caught. (Preflight's checks of such a
--ref-load: tests/unit/test_preflight_torch_dist.py.)
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.megatron.helpers import tiny_config
from vime_engine.convert import MARKER, convert_checkpoint
from vime_engine.train.megatron_backend import MegatronTrainBackend


@pytest.fixture(scope="module")
def converted_and_other(tiny_qwen3, tmp_path_factory):
    """(the tiny model converted to torch_dist, an HF copy of it with every weight shifted by 0.5)."""
    root = tmp_path_factory.mktemp("initial-weights")
    convert_checkpoint(tiny_qwen3, root / "torch_dist", "hf_to_megatron")
    other = root / "other-hf"
    shutil.copytree(tiny_qwen3, other)
    weights = load_file(other / "model.safetensors")
    save_file({k: (v + 0.5).contiguous() for k, v in weights.items()}, other / "model.safetensors",
              metadata={"format": "pt"})
    return root / "torch_dist", other


def test_trainer_starts_from_the_converted_checkpoint_and_exports_hf(tiny_qwen3, converted_and_other, tmp_path):
    converted, other_hf = converted_and_other
    cfg = tiny_config(other_hf, ref_load=str(converted), use_kl_loss=True, kl_loss_coef=0.1)
    backend = MegatronTrainBackend(cfg)
    assert backend.initial_weights == str(converted)

    source = load_file(tiny_qwen3 / "model.safetensors")
    trained_from = dict(backend.named_weights())
    for name, tensor in source.items():
        assert torch.equal(trained_from[name], tensor), name  # the converted weights, not --hf-checkpoint's
    reference = {name: t for name, t in backend.mm.hf_weight_stream(backend.arch, backend.ref_model, True)}
    assert all(torch.equal(reference[name], source[name]) for name in source)  # the KL reference too

    export = backend.save_hf(tmp_path / "hf")
    exported = load_file(export / "model.safetensors")
    assert all(torch.equal(exported[name], trained_from[name]) for name in exported)
    # config and tokenizer come from --hf-checkpoint; nothing of the torch_dist layout leaks into the export
    assert (export / "config.json").read_bytes() == (other_hf / "config.json").read_bytes()
    assert (export / "tokenizer.json").is_file()
    assert not {"latest_checkpointed_iteration.txt", MARKER} & {p.name for p in export.iterdir()}

