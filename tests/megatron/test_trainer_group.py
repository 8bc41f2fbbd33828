"""Megatron through the engine's own trainer group: ranks launched as Ray actors by `TrainerGroup` (gloo on CPU),
TP=2, PP=2 (one layer a stage; the tied embedding shared by the first and last stage) and DP=2 each reproducing
one rank, and the distributed checkpoint saved by the group resuming in it. The tiny MoE likewise at EP=2 (each
rank four of the eight experts, tokens dealt by gloo's all_to_all) and at TP=2 with sequence parallelism, whose
experts split over both ranks (ETP=2); EP=2's torch_dist checkpoint of the experts resumes bit-identical. The MoE
runs replay their routing (--use-routing-replay, through Megatron's router replay): recorded in the old-policy pass
(under sequence parallelism each rank routes and records half of each micro-batch's sequence, gathered) and replayed
in the rollout's second optimizer step, as one rank does. At PP=2, EP=2 and TP=2 with ETP=2 Megatron-Bridge's
export of the trained ranks (`--megatron-to-hf-mode bridge`) equals ours.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from tests.megatron.helpers import fixed_rollout, tiny_config
from vime_engine.devices.accelerator import CPU
from vime_engine.runtime.cluster import ray_cluster
from vime_engine.runtime.trainer_group import TrainerGroup


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(num_cpus=4):
        yield


def _trained(model_dir: Path, **layout) -> tuple[dict, dict, TrainerGroup]:
    group = TrainerGroup(tiny_config(model_dir, **layout), CPU)
    vocab = ray.get(group.leader.__ray_call__.remote(lambda self: self.backend.vocab_size))
    metrics = group.train(fixed_rollout(vocab))
    return metrics, group.weights(), group


def _through_the_bridge(group: TrainerGroup, model_dir: Path, reload: bool = False) -> list[tuple]:
    """Megatron-Bridge's side (`--megatron-to-hf-mode bridge`'s mapping), run by every rank at once (collective):
    per rank, the group's trained weights exported through it and, with `reload`, `model_dir`'s HF weights loaded back
    into the rank's shards through it, exported by ours, with the rank's output layer (a pipeline's last stage holds
    its own copy of a tied embedding)."""
    def bridge_side(rank):
        backend, mm = rank.backend, rank.backend.mm
        bridge = mm.hf_mapping("bridge", backend.arch, model_dir)
        exported = {name: tensor.clone() for name, tensor in  # copies: the reload below writes the parameters
                    mm.hf_weight_stream(backend.arch, backend.model, with_lm_head=True, mapping=bridge)}
        if not reload:
            return exported, None, None
        mm.load_weights_from(backend.model, model_dir, backend.arch, bridge)
        output_layer = getattr(mm.unwrap(backend.model[0]), "output_layer", None)
        weight = None if output_layer is None or output_layer.weight is None else output_layer.weight.detach().clone()
        return exported, dict(mm.hf_weight_stream(backend.arch, backend.model, with_lm_head=False)), weight

    return ray.get([rank.__ray_call__.remote(bridge_side) for rank in group.ranks])


def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def one_rank(tiny_qwen3, cluster):
    metrics, weights, group = _trained(tiny_qwen3)
    group.shutdown()
    return metrics, weights


@pytest.mark.parametrize("layout", [
    {"tensor-model-parallel-size": 2, "actor-num-gpus-per-node": 2},
    {"pipeline-model-parallel-size": 2, "actor-num-gpus-per-node": 2},
    {"actor-num-gpus-per-node": 2},
], ids=["tp2", "pp2", "dp2"])
def test_group_of_two_ranks_trains_like_one(tiny_qwen3, one_rank, layout):
    metrics, weights, group = _trained(tiny_qwen3, **layout)
    try:
        ref_metrics, ref_weights = one_rank
        for key in ("train/pg_loss", "train/ppo_kl", "train/entropy_loss"):
            assert metrics[key] == pytest.approx(ref_metrics[key], abs=1e-5), key
        assert set(weights) == set(ref_weights)
        assert max((weights[n] - ref_weights[n]).abs().max().item() for n in weights) < 5e-5
        if "pipeline-model-parallel-size" in layout:  # the bridge gathers the stages, the tied embedding once,
            (exported, reloaded, _), (_, _, last_stage_head) = _through_the_bridge(group, tiny_qwen3, reload=True)
            source = load_file(tiny_qwen3 / "model.safetensors")
            _assert_same(exported, weights)
            _assert_same(reloaded, source)  # and fills both stages' copies of it on the way in
            assert torch.equal(last_stage_head, source["model.embed_tokens.weight"])
    finally:
        group.shutdown()


def test_group_checkpoint_resumes_in_a_new_group(tiny_qwen3, cluster, tmp_path):
    tp2 = {"tensor-model-parallel-size": 2, "actor-num-gpus-per-node": 2}
    _, _, group = _trained(tiny_qwen3, **tp2)
    group.save_state(str(tmp_path / "ckpt"))
    vocab = ray.get(group.leader.__ray_call__.remote(lambda self: self.backend.vocab_size))
    expected_metrics = group.train(fixed_rollout(vocab, seed=1))
    expected = group.weights()
    group.shutdown()

    from vime_engine.checkpoint.manifest import build_manifest

    resumed = TrainerGroup(tiny_config(tiny_qwen3, **tp2), CPU)
    try:
        resumed.load_state(str(tmp_path / "ckpt"), build_manifest(tmp_path / "ckpt").files)
        metrics = resumed.train(fixed_rollout(vocab, seed=1))
        assert metrics["train/pg_loss"] == expected_metrics["train/pg_loss"]
        weights = resumed.weights()
        assert all((weights[n] == expected[n]).all() for n in expected)  # bit-identical: the same ranks' math
    finally:
        resumed.shutdown()


REPLAY = {"use-routing-replay": True}


@pytest.fixture(scope="module")
def one_rank_moe(tiny_qwen3_moe, cluster):
    metrics, weights, group = _trained(tiny_qwen3_moe, **REPLAY)
    group.shutdown()
    assert 0 < metrics["train/routing_replay_match"] < 1  # the second step replayed routing its routers left
    return metrics, weights


EP2 = {"expert-model-parallel-size": 2, "actor-num-gpus-per-node": 2, **REPLAY}


@pytest.mark.parametrize("layout", [
    EP2, {"tensor-model-parallel-size": 2, "sequence-parallel": True, "actor-num-gpus-per-node": 2, **REPLAY},
], ids=["ep2", "tp2-sp-etp2"])
def test_moe_group_of_two_expert_parallel_ranks_trains_like_one(tiny_qwen3_moe, one_rank_moe, layout, tmp_path):
    metrics, weights, group = _trained(tiny_qwen3_moe, **layout)
    try:
        ref_metrics, ref_weights = one_rank_moe
        for key in ("train/pg_loss", "train/ppo_kl", "train/entropy_loss", "train/routing_replay_match"):
            assert metrics[key] == pytest.approx(ref_metrics[key], abs=1e-5), key
        assert set(weights) == set(ref_weights)  # every expert, gathered into its HF name
        assert max((weights[n] - ref_weights[n]).abs().max().item() for n in weights) < 5e-5
        # Megatron-Bridge gathers the same experts (over EP ranks, or their halves over ETP ranks) into the same names
        # and deals them out again as ours does
        (exported, reloaded, _), _ = _through_the_bridge(group, tiny_qwen3_moe, reload=layout is not EP2)
        _assert_same(exported, weights)
        if layout is not EP2:
            _assert_same(reloaded, load_file(tiny_qwen3_moe / "model.safetensors"))
            return
        group.save_state(str(tmp_path / "ckpt"))
        vocab = ray.get(group.leader.__ray_call__.remote(lambda self: self.backend.vocab_size))
        expected_metrics, expected = group.train(fixed_rollout(vocab, seed=1)), group.weights()
    finally:
        group.shutdown()

    from vime_engine.checkpoint.manifest import build_manifest

    resumed = TrainerGroup(tiny_config(tiny_qwen3_moe, **EP2), CPU)
    try:
        resumed.load_state(str(tmp_path / "ckpt"), build_manifest(tmp_path / "ckpt").files)
        assert resumed.train(fixed_rollout(vocab, seed=1))["train/pg_loss"] == expected_metrics["train/pg_loss"]
        weights = resumed.weights()
        assert all((weights[n] == expected[n]).all() for n in expected)
    finally:
        resumed.shutdown()
