"""MegatronTrainBackend on CPU: log-probs and a training step against the torch backend on the same weights (the
tiny Qwen3, and the tiny Qwen3-MoE through Megatron's MoE layers), routing replay through Megatron's router replay
(the experts read from its routers' output, not from the replay's bookkeeping), exact resume through Megatron's
distributed checkpointing, the HF weight stream and save_hf."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.megatron.helpers import fixed_rollout, tiny_config
from tests.support.tolerance import assert_fp32_close, fp32_tolerance, model_depth
from vime_engine.checkpoint.finite import DivergenceError, NonFiniteCheckpoint
from vime_engine.checkpoint.manifest import build_manifest
from vime_engine.train.megatron_backend import MegatronTrainBackend
from vime_engine.train.routing_replay import RoutingPass
from vime_engine.train.torch_backend import TorchTrainBackend


def _weights(backend: MegatronTrainBackend) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in backend.named_weights()}


def _model_dims(model_dir) -> tuple[dict, dict[str, int]]:
    """config.json and the dimensions tests/support/tolerance.py bounds fp32 rounding by."""
    model = json.loads((model_dir / "config.json").read_text())
    return model, {"hidden_size": model["hidden_size"], "num_layers": model["num_hidden_layers"]}


def _assert_metrics_close(metrics: dict[str, float], expected: dict[str, float], keys: tuple[str, ...],
                          dims: dict[str, int]) -> None:
    """Two implementations' step metrics agree to fp32 rounding of their magnitude."""
    for key in keys:
        bound = fp32_tolerance(expected[key], dims["hidden_size"], model_depth(dims["num_layers"]))
        assert abs(metrics[key] - expected[key]) <= bound, key


def test_log_probs_and_training_match_the_torch_backend(tiny_qwen3):
    # Two implementations of one forward: they agree to fp32 rounding (tests/support/tolerance.py), not bit for bit.
    _, dims = _model_dims(tiny_qwen3)
    cfg = tiny_config(tiny_qwen3)
    megatron, reference = MegatronTrainBackend(cfg), TorchTrainBackend(cfg)
    samples = fixed_rollout(megatron.vocab_size)
    # The pad token as real content, as SmolLM2's end of turn is: both backends train its embedding row.
    pad = json.loads((tiny_qwen3 / "config.json").read_text())["pad_token_id"]
    samples[0].prompt_tokens[1] = samples[2].response_tokens[1] = pad

    ours, theirs = megatron.log_probs(samples), reference.log_probs(samples)
    assert ours.shape == theirs.shape == (sum(s.response_length for s in samples),)
    assert_fp32_close(ours, theirs, **dims)

    before = _weights(megatron)
    metrics = megatron.train_rollout(samples)
    expected = reference.train_rollout(samples)
    _assert_metrics_close(metrics, expected, ("train/pg_loss", "train/ppo_kl", "train/train_rollout_logprob_abs_diff",
                                              "train/entropy_loss", "train/grad_norm"), dims)
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
    _, dims = _model_dims(tiny_qwen3_moe)
    cfg = tiny_config(tiny_qwen3_moe)
    megatron, reference = MegatronTrainBackend(cfg), TorchTrainBackend(cfg)
    samples = fixed_rollout(megatron.vocab_size)
    assert_fp32_close(megatron.log_probs(samples), reference.log_probs(samples), **dims)

    metrics, expected = megatron.train_rollout(samples), reference.train_rollout(samples)
    _assert_metrics_close(metrics, expected, ("train/pg_loss", "train/ppo_kl", "train/entropy_loss"), dims)
    assert_fp32_close(megatron.log_probs(samples), reference.log_probs(samples), **dims)
    source = load_file(tiny_qwen3_moe / "model.safetensors")
    trained = _weights(megatron)
    assert set(source) <= set(trained) and "model.layers.1.mlp.experts.7.down_proj.weight" in trained
    assert (trained["model.layers.1.mlp.experts.7.down_proj.weight"] - source[
        "model.layers.1.mlp.experts.7.down_proj.weight"]).abs().max() > 1e-4  # the experts trained


@contextlib.contextmanager
def _routing_by_forward(backend: MegatronTrainBackend):
    """Every forward of the policy: (gradients on, its input rows, {decoder layer: [tokens, top_k] the experts its
    router sent each token to, Megatron's sequence-major order}), read from the routers' routing maps."""
    from megatron.core.transformer.moe.router import TopKRouter

    model = backend.mm.unwrap(backend.model[0])
    calls: list[tuple[bool, torch.Tensor, dict[int, torch.Tensor]]] = []

    def on_model(_module, _args, kwargs):
        calls.append((torch.is_grad_enabled(), kwargs["input_ids"].clone(), {}))

    def on_router(router, _args, output):
        routing_map = output[1].detach()
        calls[-1][2][router.layer_number - 1] = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)

    handles = [model.register_forward_pre_hook(on_model, with_kwargs=True)]
    handles += [m.register_forward_hook(on_router) for m in model.modules() if isinstance(m, TopKRouter)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _routes_of(calls, samples, grad: bool) -> list[tuple[int, dict[int, torch.Tensor]]]:
    """(sample index, {layer: [len(tokens) - 1, top_k] sorted experts}) of each sample in each forward with
    gradients on (or off), the sample found by its tokens."""
    found = []
    for grad_enabled, input_ids, experts in calls:
        if grad_enabled != grad:
            continue
        rows, length = input_ids.shape
        for row in range(rows):
            index = next(i for i, s in enumerate(samples) if input_ids[row, :s.total_length].tolist() == s.tokens
                         and not input_ids[row, s.total_length:].any())
            tokens = torch.arange(samples[index].total_length - 1) * rows + row
            found.append((index, {layer: e[tokens].sort(-1).values for layer, e in experts.items()}))
    return found


def _agreement(routes, records: list[torch.Tensor]) -> float:
    """The share of token × layer decisions in `routes` that went to the experts of `records`."""
    same = [(experts == records[i][:, layer].sort(-1).values).all(-1) for i, by_layer in routes
            for layer, experts in by_layer.items()]
    return torch.cat(same).float().mean().item()


def _move_routers(named_parameters, suffix: str) -> None:
    """Every router's weights moved as a few optimizer steps at a high learning rate would move them."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, weight in sorted(named_parameters):
            if name.endswith(suffix):
                weight.add_(0.05 * torch.randn(weight.shape, generator=generator))


def test_rollout_routing_replay_sends_every_token_of_every_forward_to_the_engines_experts(tiny_qwen3_moe):
    # The engine's routing recorded by a reference forward (HF's, of the initial weights: vLLM on CPU cannot return
    # it); the trainer's routers moved since. Two optimizer steps: the old-log-prob pass replays too.
    model, dims = _model_dims(tiny_qwen3_moe)
    reference = TorchTrainBackend(tiny_config(tiny_qwen3_moe))
    samples = fixed_rollout(model["vocab_size"])
    recording = RoutingPass()
    reference._forward(reference.model, [[s] for s in samples], with_entropy=False, routing=recording)
    records = recording.records()
    for sample, record in zip(samples, records):
        sample.rollout_routed_experts = record.numpy().astype(np.uint8)  # vLLM's dtype for up to 256 experts

    cfg = tiny_config(tiny_qwen3_moe, use_rollout_routing_replay=True)
    trainer, torch_trainer = MegatronTrainBackend(cfg), TorchTrainBackend(cfg)
    torch_trainer.attention_pair_cost = None  # a forward row per sample, as Megatron's: the same tokens to count
    _move_routers(trainer.mm.unwrap(trainer.model[0]).named_parameters(), "mlp.router.weight")
    _move_routers(torch_trainer.model.named_parameters(), "mlp.gate.weight")
    with _routing_by_forward(trainer) as free:
        trainer.log_probs(samples)  # a forward outside training routes freely
    assert 0 < _agreement(_routes_of(free, samples, grad=False), records) < 1  # the routers moved: replay shows
    with _routing_by_forward(trainer) as calls:
        metrics = trainer.train_rollout(samples)
    old, trained = _routes_of(calls, samples, grad=False), _routes_of(calls, samples, grad=True)
    assert sorted(i for i, _ in old) == sorted(i for i, _ in trained) == list(range(len(samples)))
    assert _agreement(old, records) == _agreement(trained, records) == 1.0  # 100% of the tokens
    # Megatron's replay (softmax over the recorded experts' logits) trains as the torch backends' hook does.
    expected = torch_trainer.train_rollout(samples)
    _assert_metrics_close(metrics, expected, ("train/pg_loss", "train/ppo_kl", "train/entropy_loss"), dims)
    assert 0 < metrics["train/routing_replay_match"] < 1
    # The torch backend's count of the same decisions (equal here; a near tie may round the other way elsewhere).
    assert metrics["train/routing_replay_match"] == pytest.approx(expected["train/routing_replay_match"], abs=0.01)


def test_routing_replay_records_the_old_policy_pass_and_replays_it_in_each_step_and_recomputation(tiny_qwen3_moe):
    trainer = MegatronTrainBackend(tiny_config(tiny_qwen3_moe, use_routing_replay=True, lr=1e-2))
    samples = fixed_rollout(trainer.vocab_size)
    with _routing_by_forward(trainer) as calls:
        metrics = trainer.train_rollout(samples)
    weights = _weights(trainer)
    with _routing_by_forward(trainer) as free:
        trainer.log_probs(samples)  # routes freely, with the routers two steps on
    old, trained = _routes_of(calls, samples, grad=False), _routes_of(calls, samples, grad=True)
    assert sorted(i for i, _ in old) == sorted(i for i, _ in trained) == list(range(len(samples)))
    records = [None] * len(samples)
    for i, by_layer in old:
        records[i] = torch.stack([by_layer[layer] for layer in sorted(by_layer)], dim=1)
    assert _agreement(trained, records) == 1.0  # the second step's samples too, after the first step moved them
    assert 0 < _agreement(_routes_of(free, samples, grad=False), records) < 1
    assert 0 < metrics["train/routing_replay_match"] < 1
    # Recomputed in its backward, a micro-batch's MoE layers replay its routing again: the same step, bit for bit.
    recompute = {"recompute-granularity": "full", "recompute-method": "uniform", "recompute-num-layers": 1}
    recomputing = MegatronTrainBackend(tiny_config(tiny_qwen3_moe, use_routing_replay=True, lr=1e-2, **recompute))
    assert recomputing.train_rollout(samples) == metrics
    assert all(torch.equal(tensor, weights[name]) for name, tensor in _weights(recomputing).items())


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
