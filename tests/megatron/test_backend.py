"""MegatronTrainBackend on CPU: log-probs and a training step against the torch backend on the same weights (the
tiny Qwen3, and the tiny Qwen3-MoE through Megatron's MoE layers), exact resume through Megatron's distributed
checkpointing, the HF weight stream and save_hf."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.megatron.helpers import fixed_rollout, tiny_config
from tests.support.tolerance import assert_fp32_close, fp32_tolerance, model_depth
from vime_engine.checkpoint.finite import DivergenceError, NonFiniteCheckpoint
from vime_engine.checkpoint.manifest import build_manifest
from vime_engine.train.megatron_backend import MegatronTrainBackend
from vime_engine.train.torch_backend import TorchTrainBackend


def _weights(backend: MegatronTrainBackend) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in backend.named_weights()}


def test_log_probs_and_training_match_the_torch_backend(tiny_qwen3):
    # Two implementations of one forward: they agree to fp32 rounding (tests/support/tolerance.py), not bit for bit.
    model = json.loads((tiny_qwen3 / "config.json").read_text())
    dims = {"hidden_size": model["hidden_size"], "num_layers": model["num_hidden_layers"]}
    cfg = tiny_config(tiny_qwen3)
    megatron, reference = MegatronTrainBackend(cfg), TorchTrainBackend(cfg)
    samples = fixed_rollout(megatron.vocab_size)

    ours, theirs = megatron.log_probs(samples), reference.log_probs(samples)
    assert ours.shape == theirs.shape == (sum(s.response_length for s in samples),)
    assert_fp32_close(ours, theirs, **dims)

    before = _weights(megatron)
    metrics = megatron.train_rollout(samples)
    expected = reference.train_rollout(samples)
    for key in ("train/pg_loss", "train/ppo_kl", "train/train_rollout_logprob_abs_diff", "train/entropy_loss"):
        bound = fp32_tolerance(expected[key], dims["hidden_size"], model_depth(dims["num_layers"]))
        assert abs(metrics[key] - expected[key]) <= bound, key
    after = _weights(megatron)
    torch_state = dict(reference.named_weights())
    assert set(after) == set(torch_state)
    moved = max((after[n] - before[n]).abs().max().item() for n in after)
    assert moved > 1e-4  # lr 1e-3: Adam moves every trained weight by about lr
    # Adam divides by sqrt(v): where a gradient is ~0, float-rounding differences in it move a weight by a
    # visible fraction of lr, so weights agree to a few percent of one step, not to 1e-5.
    assert max((after[n] - torch_state[n]).abs().max().item() for n in after) < 5e-5
    assert_fp32_close(megatron.log_probs(samples), reference.log_probs(samples), **dims)


def test_the_moe_model_through_megatrons_moe_layers_matches_the_torch_backend(tiny_qwen3_moe):
    # The same routing (top-2 of 8, renormalised) in two implementations: log-probs and the step's losses agree to
    # fp32 rounding; the step moves both models to the same log-probs again.
    model = json.loads((tiny_qwen3_moe / "config.json").read_text())
    dims = {"hidden_size": model["hidden_size"], "num_layers": model["num_hidden_layers"]}
    cfg = tiny_config(tiny_qwen3_moe)
    megatron, reference = MegatronTrainBackend(cfg), TorchTrainBackend(cfg)
    samples = fixed_rollout(megatron.vocab_size)
    assert_fp32_close(megatron.log_probs(samples), reference.log_probs(samples), **dims)

    metrics, expected = megatron.train_rollout(samples), reference.train_rollout(samples)
    for key in ("train/pg_loss", "train/ppo_kl", "train/entropy_loss"):
        bound = fp32_tolerance(expected[key], dims["hidden_size"], model_depth(dims["num_layers"]))
        assert abs(metrics[key] - expected[key]) <= bound, key
    assert_fp32_close(megatron.log_probs(samples), reference.log_probs(samples), **dims)
    source = load_file(tiny_qwen3_moe / "model.safetensors")
    trained = _weights(megatron)
    assert set(source) <= set(trained) and "model.layers.1.mlp.experts.7.down_proj.weight" in trained
    assert (trained["model.layers.1.mlp.experts.7.down_proj.weight"] - source[
        "model.layers.1.mlp.experts.7.down_proj.weight"]).abs().max() > 1e-4  # the experts trained


def test_resume_from_dist_checkpoint_is_exact(tiny_qwen3, tmp_path):
    cfg = tiny_config(tiny_qwen3)
    first = MegatronTrainBackend(cfg)
    samples = fixed_rollout(first.vocab_size)
    first.train_rollout(samples)
    first.save_state(tmp_path / "state")
    first.train_rollout(samples)
    uninterrupted = _weights(first)

    resumed = MegatronTrainBackend(cfg)
    resumed.load_state(tmp_path / "state", build_manifest(tmp_path / "state").files)
    resumed.train_rollout(samples)
    for name, tensor in _weights(resumed).items():
        assert torch.equal(tensor, uninterrupted[name]), name

    # A diverged state is not saved, and a torch_dist checkpoint holding NaN (saved before saves refused it) is
    # refused on load before any of it is applied.
    with torch.no_grad():
        next(resumed.model[0].parameters()).view(-1)[0] = float("nan")
    with pytest.raises(DivergenceError, match=r"diverged: 1 tensors hold NaN or inf \(model0\.module\."):
        resumed.save_state(tmp_path / "diverged")
    assert not (tmp_path / "diverged").exists()
    resumed.mm.save_torch_dist(resumed._sharded_state(is_loading=False), tmp_path / "diverged")
    with pytest.raises(NonFiniteCheckpoint, match=r"diverged: \d+ tensors hold NaN or inf \(model\..*not resumed"):
        first.load_state(tmp_path / "diverged", build_manifest(tmp_path / "diverged").files)
    # torch_dist had loaded it in place: the trainer is as built again, as if no checkpoint had been there
    source = load_file(tiny_qwen3 / "model.safetensors")
    for name, tensor in source.items():
        assert torch.equal(_weights(first)[name], tensor), name
    fresh = MegatronTrainBackend(cfg)
    first.train_rollout(samples)
    fresh.train_rollout(samples)  # and its optimizer starts afresh too: the same step
    assert all(torch.equal(tensor, _weights(fresh)[name]) for name, tensor in _weights(first).items())


def test_weight_stream_and_save_hf(tiny_qwen3, tmp_path):
    backend = MegatronTrainBackend(tiny_config(tiny_qwen3))
    weights = _weights(backend)
    source = load_file(tiny_qwen3 / "model.safetensors")
    assert "lm_head.weight" in weights  # tied embeddings: vLLM still needs the name
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    for name, tensor in source.items():
        assert torch.equal(weights[name], tensor), name

    out = backend.save_hf(tmp_path / "hf")
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(saved[n], source[n]) for n in source)
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
