"""Routing replay on the tiny Qwen3-MoE (vime_engine/train/routing_replay.py): the gate's math, the forward's experts
after the weights moved, and both flags through a rollout's training (--use-routing-replay records in the old-policy
pass, --use-rollout-routing-replay takes each sample's engine routing, here recorded by a reference forward: vLLM on
CPU cannot return it). The experts a forward used are read where HF's experts module receives them, not from the
replay's own bookkeeping."""

from __future__ import annotations

import contextlib
import random
import re

import numpy as np
import pytest
import torch

from vime_engine.config import ConfigError, build_config
from vime_engine.models.builtin import materialize_builtin_model
from vime_engine.preflight import PreflightError, check_inputs, check_on_device
from vime_engine.sample import Sample
from vime_engine.train.megatron_layout import ParallelLayout
from vime_engine.train.megatron_routing_replay import micro_batch_routes, records_of_micro_batch, sequence_share
from vime_engine.train.rollout_batch import old_log_probs_from_training_forward
from vime_engine.train.routing_replay import RoutingPass, replayed_gate_weights, rollout_record
from vime_engine.train.torch_backend import TorchTrainBackend


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return materialize_builtin_model("tiny-qwen3-moe", tmp_path_factory.mktemp("tiny-moe") / "model")


def _config(moe_dir, **flags):
    return build_config([], **{"hf-checkpoint": str(moe_dir), "prompt-data": "unused", "rollout-batch-size": 8,
                               "n-samples-per-prompt": 1, "advantage-estimator": "reinforce_plus_plus", **flags})


def _samples(seed: int = 0, count: int = 8) -> list[Sample]:
    """Samples with prompts of their own (a forward row each) and rewards to learn from."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = rng.randrange(3, 10)
        out.append(Sample(i, "", "", [rng.randrange(10, 400) for _ in range(rng.randrange(3, 9))],
                          [rng.randrange(10, 400) for _ in range(n)], rollout_log_probs=[-3.0] * n,
                          loss_mask=[1] * n, reward=float(i % 2)))
    return out


@contextlib.contextmanager
def _experts_by_call(model):
    """Every forward of `model`: (gradients on, its input rows, {decoder layer: [positions, top_k] the experts
    module was handed}), read from HF's Qwen3MoeExperts inputs."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    calls: list[tuple[bool, list[tuple[int, ...]], dict[int, torch.Tensor]]] = []

    def on_model(_module, _args, kwargs):
        calls.append((torch.is_grad_enabled(), [tuple(row.tolist()) for row in kwargs["input_ids"]], {}))

    def on_experts(layer):
        return lambda _module, args: calls[-1][2].__setitem__(layer, args[1].detach().clone())

    handles = [model.register_forward_pre_hook(on_model, with_kwargs=True)]
    for name, module in model.named_modules():
        if isinstance(module, Qwen3MoeExperts):
            handles.append(module.register_forward_pre_hook(on_experts(int(re.search(r"layers\.(\d+)\.", name)[1]))))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _routes_of(calls, samples: list[Sample], grad: bool) -> list[dict[int, torch.Tensor]]:
    """Per forward with gradients on (or off) and sample in it: {layer: [len(tokens) - 1, top_k]} the experts its
    tokens but the last went to (each sample in a row of its own, found by its tokens)."""
    by_tokens = {tuple(s.tokens): s for s in samples}
    found = []
    for grad_enabled, rows, experts in calls:
        if grad_enabled != grad:
            continue
        length = len(rows[0])
        for r, row in enumerate(rows):
            sample = next(s for tokens, s in by_tokens.items() if row[:len(tokens)] == tokens)
            positions = slice(r * length, r * length + sample.total_length - 1)
            found.append((sample, {layer: e[positions] for layer, e in experts.items()}))
    return found


def _move_routers(backend: TorchTrainBackend) -> None:
    """The routers' weights moved as a few optimizer steps at a high learning rate would move them."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in backend.model.model.layers:
            layer.mlp.gate.weight.add_(0.02 * torch.randn(layer.mlp.gate.weight.shape, generator=generator))


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def test_the_replayed_gate_weights_are_the_routers_own_and_train_only_the_recorded_experts(moe_dir):
    router = TorchTrainBackend(_config(moe_dir)).model.model.layers[0].mlp.gate
    hidden = torch.randn(6, router.hidden_dim, generator=torch.Generator().manual_seed(0))
    logits, weights, experts = router(hidden)
    assert torch.equal(replayed_gate_weights(logits, experts, renormalise=True), weights)
    # Other experts: the softmax over the recorded two, which depends on their logits alone.
    recorded = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [0, 7], [3, 5]])
    replayed = replayed_gate_weights(logits, recorded, renormalise=True)
    torch.testing.assert_close(replayed, torch.softmax(logits.gather(-1, recorded), dim=-1))
    replayed[:, 0].sum().backward()
    touched = router.weight.grad.abs().sum(dim=1) > 0
    assert touched.tolist() == [True] * 8  # every expert is recorded for some token
    router.weight.grad = None
    replayed_gate_weights(router(hidden[:1])[0], recorded[:1], renormalise=True)[:, 0].sum().backward()
    per_expert = router.weight.grad.abs().sum(dim=1)  # the others' only through rounding in the full softmax
    assert per_expert[:2].min() > 1e5 * per_expert[2:].max()


def test_after_the_weights_moved_the_forward_sends_every_token_to_its_recorded_experts(moe_dir):
    backend = TorchTrainBackend(_config(moe_dir))
    samples = _samples()
    rows = [[s] for s in samples]
    recording = RoutingPass()
    before = backend._forward(backend.model, rows, with_entropy=False, routing=recording)[0]
    records = recording.records()
    assert [tuple(r.shape) for r in records] == [(s.total_length - 1, 2, 2) for s in samples]
    _move_routers(backend)

    with _experts_by_call(backend.model) as calls:
        backend._forward(backend.model, rows, with_entropy=False)
        replay = RoutingPass(records)
        after = backend._forward(backend.model, rows, with_entropy=False, routing=replay)[0]
    fresh, replayed = (_routes_of([call], samples, grad=True) for call in calls)
    agree = [_same_sets(experts[layer], record[:, layer]) for (_, experts), record in zip(fresh, records)
             for layer in (0, 1)]
    assert 0 < torch.cat(agree).float().mean() < 1  # the fresh routing moved: dropping the replay shows
    for (_, experts), record in zip(replayed, records):
        for layer in (0, 1):
            assert _same_sets(experts[layer], record[:, layer]).all()  # 100% of the tokens
    assert (replay.matched, replay.replayed) == (int(torch.cat(agree).sum()), sum(a.numel() for a in agree))
    assert not torch.equal(before, after)


def test_replaying_the_routers_own_choice_changes_nothing_and_another_choice_changes_the_log_probs(moe_dir):
    backend = TorchTrainBackend(_config(moe_dir))
    samples = _samples(1)
    rows = [[samples[0], Sample(0, "", "", samples[0].prompt_tokens, [17, 18, 19])], [samples[1]]]
    recording = RoutingPass()
    plain, entropy, _ = backend._forward(backend.model, rows, with_entropy=True, routing=recording)
    own, own_entropy, _ = backend._forward(backend.model, rows, with_entropy=True,
                                           routing=RoutingPass(recording.records()))
    assert torch.equal(own, plain) and torch.equal(own_entropy, entropy)
    other = [torch.tensor([[0, 1], [2, 3]]).expand(len(r), 2, 2) for r in recording.records()]
    assert not torch.allclose(backend._forward(backend.model, rows, False, routing=RoutingPass(other))[0], plain)


def test_routing_replay_records_in_a_separate_old_policy_pass_and_rollout_routing_needs_none(moe_dir):
    assert not old_log_probs_from_training_forward(_config(moe_dir, **{"use-routing-replay": True}), 8)
    assert old_log_probs_from_training_forward(_config(moe_dir, **{"use-rollout-routing-replay": True}), 8)
    assert old_log_probs_from_training_forward(_config(moe_dir), 8)


def test_routing_replay_keeps_the_old_policys_routing_through_the_rollouts_optimizer_steps(moe_dir):
    flags = {"rollout-batch-size": 4, "global-batch-size": 2, "micro-batch-size": 1, "lr": 1e-2}
    samples = _samples(2, count=4)
    seen = {}
    for replay in (False, True):
        backend = TorchTrainBackend(_config(moe_dir, **flags, **{"use-routing-replay": replay}))
        with _experts_by_call(backend.model) as calls:
            metrics = backend.train_rollout(samples)
        old = {id(s): experts for s, experts in _routes_of(calls, samples, grad=False)}
        seen[replay] = metrics, old, _routes_of(calls, samples, grad=True)
    metrics, old, trained = seen[True]
    assert len(old) == len(trained) == len(samples)  # the old-policy pass ran, one forward a sample
    for sample, experts in trained:
        for layer in (0, 1):
            assert torch.equal(experts[layer], old[id(sample)][layer])  # the second step's samples too
    # Without the replay the second step's samples went where the moved routers sent them.
    free_metrics, free_old, free = seen[False]
    share = torch.cat([_same_sets(e[layer], free_old[id(s)][layer]) for s, e in free for layer in (0, 1)])
    assert "train/routing_replay_match" not in free_metrics
    assert 0 < share.float().mean() < 1
    # Both runs were the same up to the second step: the replay's count of fresh agreement is the free run's.
    assert metrics["train/routing_replay_match"] == pytest.approx(share.float().mean().item(), abs=1e-6)


@pytest.fixture(scope="module")
def engine_samples(moe_dir) -> list[Sample]:
    """Samples whose rollout_routed_experts a reference forward of the initial weights recorded: what the engine
    computed while generating them, in vLLM's dtype for up to 256 experts."""
    samples = _samples(3)
    reference = TorchTrainBackend(_config(moe_dir))
    recording = RoutingPass()
    reference._forward(reference.model, [[s] for s in samples], with_entropy=False, routing=recording)
    for sample, record in zip(samples, recording.records()):
        sample.rollout_routed_experts = record.numpy().astype(np.uint8)
    return samples


@pytest.mark.parametrize("steps", [1, 2])
def test_rollout_routing_replay_sends_every_token_of_every_policy_forward_to_the_engines_experts(
        moe_dir, engine_samples, steps):
    samples = engine_samples
    flags = {"use-rollout-routing-replay": True, "global-batch-size": 8 // steps, "micro-batch-size": 2}
    trainer = TorchTrainBackend(_config(moe_dir, **flags))
    _move_routers(trainer)  # the trainer's weights moved on past the engine's
    with _experts_by_call(trainer.model) as calls:
        metrics = trainer.train_rollout(samples)
    trained, old = _routes_of(calls, samples, grad=True), _routes_of(calls, samples, grad=False)
    assert len(trained) == len(samples) and len(old) == (0 if steps == 1 else len(samples))  # the old pass: 2 steps
    for sample, experts in trained + old:
        engine = torch.as_tensor(sample.rollout_routed_experts).long()
        for layer in (0, 1):
            assert torch.equal(experts[layer].sort(-1).values, engine[:, layer].sort(-1).values)
    assert 0 < metrics["train/routing_replay_match"] < 1


def test_megatrons_replay_targets_are_the_records_in_its_sequence_major_token_order():
    # Megatron routes a micro-batch's [sequence, rows] tokens flattened: position s of row b is token s·rows + b; a
    # rank under sequence parallelism routes its slice of the sequence; the rest of a row replays experts 0..k-1.
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 3, 7]
    records = [torch.randint(0, 8, (n - 1, 3, 2), generator=generator) for n in lengths]
    targets, covered = micro_batch_routes(records, lengths, 8, [0, 2], 2)
    assert targets.shape == (2, 8 * 3, 2) and covered.shape == (8 * 3,)
    for row, (record, n) in enumerate(zip(records, lengths)):
        for s in range(8):
            token = s * 3 + row
            assert covered[token] == (s < n - 1)
            expected = record[s][[0, 2]] if s < n - 1 else torch.tensor([[0, 1], [0, 1]])
            assert torch.equal(targets[:, token], expected)
    back = records_of_micro_batch(targets, lengths, 3, [0, 2])
    assert all(torch.equal(b[:, [0, 2]], r[:, [0, 2]]) and not b[:, 1].any() for b, r in zip(back, records))
    layout = ParallelLayout(tensor=2, sequence_parallel=True)
    shares = [micro_batch_routes(records, lengths, 8, [0, 2], 2, sequence_share(8, layout, rank)) for rank in (0, 1)]
    assert torch.equal(torch.cat([t for t, _ in shares], dim=1), targets)
    assert torch.equal(torch.cat([c for _, c in shares]), covered)
    with pytest.raises(ValueError, match="a routing record of 4 rows for a sample of 3 tokens"):
        micro_batch_routes(records[:1], [3], 8, [0], 2)


def test_a_rollout_record_that_breaks_the_contract_is_refused_naming_the_sample():
    sample = Sample(7, "", "", [1, 2, 3], [4, 5])
    with pytest.raises(ValueError, match="sample of group 7 has no rollout_routed_experts"):
        rollout_record(sample, num_layers=2, top_k=2, num_experts=8)
    sample.rollout_routed_experts = np.zeros((5, 2, 2), dtype=np.uint8)
    with pytest.raises(ValueError, match=re.escape("shape (5, 2, 2), expected (4, 2, 2)")):
        rollout_record(sample, num_layers=2, top_k=2, num_experts=8)
    sample.rollout_routed_experts = np.full((4, 2, 2), 8, dtype=np.uint8)
    with pytest.raises(ValueError, match=re.escape("experts outside [0, 8)")):
        rollout_record(sample, num_layers=2, top_k=2, num_experts=8)


@pytest.mark.parametrize("flag", ["use-routing-replay", "use-rollout-routing-replay"])
def test_replay_needs_a_replayable_mixture_of_experts_model_and_a_layout_megatron_replays(
        flag, moe_dir, tiny_model, tmp_path, arithmetic_data):
    named = f"--{flag}"
    with pytest.raises(PreflightError, match=f"{named}: the model has no experts"):
        check_inputs(build_config([], **{"hf-checkpoint": str(tiny_model), "prompt-data": str(arithmetic_data),
                                         "input-key": "question", "label-key": "answer", flag: True}))
    base = {"prompt-data": str(arithmetic_data), "input-key": "question", "label-key": "answer", flag: True}
    megatron = {"hf-checkpoint": str(moe_dir), "train-backend": "megatron", **base}
    check_inputs(build_config([], **megatron))  # Megatron's own router replay
    with pytest.raises(PreflightError, match=f"{named} with --recompute-granularity full and "
                                             "--pipeline-model-parallel-size 2: .*REPLAY_BACKWARD"):
        check_inputs(build_config(["--recompute-granularity", "full", "--recompute-method", "uniform",
                                   "--recompute-num-layers", "1", "--pipeline-model-parallel-size", "2",
                                   "--actor-num-gpus-per-node", "2"], **megatron))
    other = tmp_path / "mixtral-like"
    other.mkdir()
    for path in moe_dir.iterdir():
        (other / path.name).write_bytes(path.read_bytes())
    (other / "config.json").write_text((moe_dir / "config.json").read_text().replace('"qwen3_moe"', '"olmoe"'))
    with pytest.raises(PreflightError, match=f"{named}: the torch backends replay the router of qwen3_moe"):
        check_inputs(build_config([], **{"hf-checkpoint": str(other), **base}))
    check_inputs(build_config([], **{"hf-checkpoint": str(moe_dir), **base}))


def test_rollout_routing_replay_is_refused_on_cpu_naming_the_platform_and_where_it_is_not_built():
    cfg = build_config([], **{"hf-checkpoint": "m", "prompt-data": "p", "use-rollout-routing-replay": True})
    with pytest.raises(PreflightError, match="vLLM's CPU backend .* cannot return the experts"):
        check_on_device(cfg, "cpu")
    check_on_device(cfg, "cuda")
    check_on_device(build_config([], **{"hf-checkpoint": "m", "prompt-data": "p", "use-routing-replay": True}), "cpu")
    for flags, named in ((["--rollout-mode", "server"], "/inference/v1/generate"),
                         (["--custom-generate-function-path", "agent.py:generate"], "--custom-generate-function-path"),
                         (["--vllm-enable-prefix-caching", "false"], "prefix cache")):
        with pytest.raises(ConfigError, match=f"--use-rollout-routing-replay: .*{re.escape(named)}"):
            build_config(["--use-rollout-routing-replay", *flags], **{"hf-checkpoint": "m", "prompt-data": "p"})
