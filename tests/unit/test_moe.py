"""The tiny mixture-of-experts model on the torch backend: the router's load-balancing loss (HF's aux_loss) under
--moe-aux-loss-coeff; vime's MoE model flags checked against config.json, its MoE run settings and the expert-parallel
layout checked before anything starts."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from vime_engine.config import ConfigError, build_config, with_overrides
from vime_engine.models.builtin import materialize_builtin_model
from vime_engine.preflight import PreflightError, check_inputs
from vime_engine.sample import Sample
from vime_engine.train.megatron_model_flags import (
    ModelFlagMismatch,
    check_expert_layout,
    check_model_flags,
    megatron_layer_pattern,
    moe_layer_pattern,
)
from vime_engine.train.objective import MicroBatchOutputs, MicroBatchTargets, micro_batch_loss
from vime_engine.train.torch_backend import TorchTrainBackend

# vime's scripts/models/qwen3-30B-A3B.sh MoE flags, with the tiny MoE's values (our transcription of the names).
TINY_MOE_FLAGS = {"num-experts": 8, "moe-router-topk": 2, "moe-ffn-hidden-size": 64,
                  "moe-router-score-function": "softmax", "moe-router-load-balancing-type": "aux_loss",
                  "qk-layernorm": True, "num-layers": 2, "hidden-size": 128, "ffn-hidden-size": 256}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return materialize_builtin_model("tiny-qwen3-moe", tmp_path_factory.mktemp("tiny-moe") / "model")


def _backend(moe_dir, coefficient: float) -> TorchTrainBackend:
    return TorchTrainBackend(build_config([], **{"hf-checkpoint": str(moe_dir), "prompt-data": "unused",
                                                 "moe-aux-loss-coeff": coefficient}))


def _sample(rng: random.Random, prompt_length: int, response_length: int) -> Sample:
    return Sample(0, "", "", [rng.randrange(10, 400) for _ in range(prompt_length)],
                  [rng.randrange(10, 400) for _ in range(response_length)])


def test_the_balance_loss_is_hfs_aux_loss_over_the_tokens_and_leaves_the_log_probs_alone(moe_dir):
    backend = _backend(moe_dir, 0.01)
    rng = random.Random(0)
    long, short = _sample(rng, 12, 9), _sample(rng, 5, 3)
    plain, _, none = backend._forward(backend.model, [[long], [short]], with_entropy=False)
    log_probs, _, aux = backend._forward(backend.model, [[long], [short]], with_entropy=False,
                                         with_moe_aux_loss=True)
    assert none is None and torch.equal(log_probs, plain)
    ids = torch.zeros(2, 21, dtype=torch.long)
    mask = torch.zeros(2, 21, dtype=torch.long)
    for row, s in enumerate([long, short]):
        ids[row, : s.total_length] = torch.tensor(s.prompt_tokens + s.response_tokens)
        mask[row, : s.total_length] = 1
    hf = backend.model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    torch.testing.assert_close(aux, hf, rtol=1e-6, atol=0)
    assert 1.9 < aux.item() < 8.0  # top-k (2) when perfectly balanced, the 8 experts' count when 2 take every token
    sibling = Sample(0, "", "", long.prompt_tokens, short.response_tokens)  # a row shares its prompt: a 4-D mask
    _, _, shared = backend._forward(backend.model, [[long, sibling]], with_entropy=False, with_moe_aux_loss=True)
    assert 1.9 < shared.item() < 8.0
    aux.backward()
    assert backend.model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # it trains the routers


def _targets(n: int) -> MicroBatchTargets:
    lengths = [3] * n
    zeros = torch.zeros(sum(lengths))
    return MicroBatchTargets(lengths, torch.ones(sum(lengths)), torch.linspace(-1, 1, sum(lengths)), None, zeros)


def test_each_micro_batch_adds_the_coefficient_times_its_sample_share_of_the_balance_loss(moe_dir):
    cfg = build_config([], **{"hf-checkpoint": str(moe_dir), "prompt-data": "unused", "moe-aux-loss-coeff": 0.25})
    log_probs = torch.linspace(-2, -0.5, 6)
    dense, dense_metrics = micro_batch_loss(cfg, MicroBatchOutputs(log_probs), _targets(2), 24, 8)
    aux = torch.tensor(1.6)
    loss, metrics = micro_batch_loss(cfg, MicroBatchOutputs(log_probs, moe_aux_loss=aux), _targets(2), 24, 8)
    assert "train/moe_aux_loss" not in dense_metrics
    assert metrics["train/moe_aux_loss"] == pytest.approx(1.6 * 2 / 8)
    assert (loss - dense).item() == pytest.approx(0.25 * 1.6 * 2 / 8)
    # Micro-batches of 2 and 6 samples: the step's metric is their sample-weighted mean.
    _, other = micro_batch_loss(cfg, MicroBatchOutputs(torch.zeros(18), moe_aux_loss=torch.tensor(1.2)),
                                _targets(6), 24, 8)
    assert metrics["train/moe_aux_loss"] + other["train/moe_aux_loss"] == pytest.approx((1.6 * 2 + 1.2 * 6) / 8)


def test_a_zero_coefficient_trains_exactly_as_without_the_flag(moe_dir):
    rng = random.Random(1)
    samples = [_sample(rng, 6, 4) for _ in range(4)]
    for s, reward in zip(samples, [1.0, 0.0, 1.0, 0.0]):
        s.reward, s.rollout_log_probs, s.loss_mask = reward, [-1.0] * 4, [1] * 4
    base = {"hf-checkpoint": str(moe_dir), "prompt-data": "unused", "rollout-batch-size": 1,
            "n-samples-per-prompt": 4}
    without = TorchTrainBackend(build_config([], **base))
    zero = TorchTrainBackend(build_config([], **base, **{"moe-aux-loss-coeff": 0}))
    on = TorchTrainBackend(build_config([], **base, **{"moe-aux-loss-coeff": 0.5}))
    metrics = [b.train_rollout(samples) for b in (without, zero, on)]
    assert metrics[0] == metrics[1]
    assert "train/moe_aux_loss" in metrics[2] and "train/moe_aux_loss" not in metrics[1]
    weights = [dict(b.named_weights()) for b in (without, zero, on)]
    name = "model.layers.0.mlp.gate.weight"
    assert torch.equal(weights[0][name], weights[1][name]) and not torch.equal(weights[0][name], weights[2][name])


def test_vimes_moe_flags_describe_the_tiny_moe(moe_dir):
    config = json.loads((moe_dir / "config.json").read_text())
    check_model_flags(TINY_MOE_FLAGS, config, "config.json")


@pytest.mark.parametrize("flags, said", [
    ({"num-experts": 128}, "--num-experts 128 disagrees with config.json num_experts = 8"),
    ({"moe-router-topk": 8}, "num_experts_per_tok = 2"),
    ({"moe-ffn-hidden-size": 768}, "moe_intermediate_size = 64"),
    ({"moe-router-score-function": "sigmoid"}, "softmax"),
    ({"moe-router-load-balancing-type": "sinkhorn"}, "aux_loss"),
])
def test_a_moe_flag_that_does_not_describe_the_model_is_refused(moe_dir, flags, said):
    config = json.loads((moe_dir / "config.json").read_text())
    with pytest.raises(ModelFlagMismatch, match=said):
        check_model_flags(flags, config, "config.json")


def test_moe_flags_on_a_dense_model_are_refused(tiny_model, arithmetic_data):
    config = json.loads((tiny_model / "config.json").read_text())
    with pytest.raises(ModelFlagMismatch, match="num_experts = None"):
        check_model_flags({"num-experts": 8}, config, "config.json")
    cfg = build_config([], **{"hf-checkpoint": str(tiny_model), "prompt-data": str(arithmetic_data),
                              "moe-aux-loss-coeff": 0.01})
    with pytest.raises(PreflightError, match="--moe-aux-loss-coeff 0.01: the model has no experts"):
        check_inputs(cfg)


# The MoE part of vime's scripts/models/qwen3-30B-A3B.sh (our transcription), with the tiny MoE's sizes: every flag
# is accepted and describes the model or says how Megatron runs its layers.
QWEN3_30B_A3B_MOE_FLAGS = [
    "--moe-ffn-hidden-size", "64", "--moe-router-score-function", "softmax", "--moe-token-dispatcher-type", "alltoall",
    "--moe-router-topk", "2", "--moe-layer-freq", "[1, 1]", "--num-experts", "8", "--moe-grouped-gemm",
    "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    "--moe-aux-loss-coeff", "0", "--rotary-percent", "1.0",
]


def test_vimes_qwen3_30b_a3b_moe_flags_pass_the_megatron_preflight_and_reach_megatrons_settings(
        moe_dir, arithmetic_data):
    from vime_engine.train.megatron_layout import ParallelLayout

    cfg = build_config([*QWEN3_30B_A3B_MOE_FLAGS, "--train-backend", "megatron", "--expert-model-parallel-size", "2",
                        "--actor-num-gpus-per-node", "2", "--global-batch-size", "2", "--input-key", "question",
                        "--label-key", "answer"],
                       **{"hf-checkpoint": str(moe_dir), "prompt-data": str(arithmetic_data)})
    check_inputs(cfg)
    moe = ParallelLayout.from_flags(cfg.megatron, cfg.algorithm.moe_aux_loss_coeff).moe
    assert (moe.token_dispatcher, moe.router_dtype, moe.grouped_gemm, moe.permute_fusion) == (
        "alltoall", "fp32", True, True)
    flex = with_overrides(cfg, **{"moe-token-dispatcher-type": "flex"})
    with pytest.raises(PreflightError, match="--moe-token-dispatcher-type flex"):  # before Ray starts
        check_inputs(flex)


@pytest.mark.parametrize("flags, said", [
    ({"moe-layer-freq": "2"}, "--moe-layer-freq 2 gives the MoE layers [0] of 2; config.json decoder_sparse_step = 1"),
    ({"moe-layer-freq": "[0]*1+[1]*1"}, "gives the MoE layers [1] of 2"),
    ({"moe-layer-freq": "__import__('os')"}, "expected an integer or a list of 0/1"),
    ({"moe-router-pre-softmax": True}, "norm_topk_prob"),
    ({"moe-router-topk-scaling-factor": 2.5}, "routed_scaling_factor"),
    ({"moe-shared-expert-intermediate-size": 64}, "no shared expert"),
    ({"moe-router-enable-expert-bias": True}, "--moe-router-enable-expert-bias true: the model does not have it"),
    ({"moe-router-bias-update-rate": 0.0}, "moves the expert bias"),
    ({"moe-router-num-groups": 8}, "config.json n_group = None"),
])
def test_a_moe_flag_for_another_router_or_layer_pattern_is_refused(moe_dir, flags, said):
    config = json.loads((moe_dir / "config.json").read_text())
    with pytest.raises(ModelFlagMismatch, match=re.escape(said)):
        check_model_flags(flags, config, "config.json")


@pytest.mark.parametrize("flags, said", [
    ({"expert-model-parallel-size": 3}, "the model's 8 experts (config.json num_experts, config.json) do not split "
                                        "evenly over 3 ranks"),
    ({"expert-model-parallel-size": 2, "tensor-model-parallel-size": 2}, "needs --sequence-parallel"),
])
def test_an_expert_layout_the_moe_cannot_take_is_refused(moe_dir, flags, said):
    config = json.loads((moe_dir / "config.json").read_text())
    check_expert_layout({"expert-model-parallel-size": 2, "tensor-model-parallel-size": 2, "sequence-parallel": True},
                        config, "config.json")
    with pytest.raises(ModelFlagMismatch, match=re.escape(said)):
        check_expert_layout(flags, config, "config.json")


def test_expert_parallelism_of_a_dense_model_is_refused(tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    with pytest.raises(ModelFlagMismatch, match="--expert-model-parallel-size 2: the model has no experts to split"):
        check_expert_layout({"expert-model-parallel-size": 2}, config, "config.json")
    with pytest.raises(ModelFlagMismatch, match="--moe-layer-freq 1: the model has no experts"):
        check_model_flags({"moe-layer-freq": "1"}, config, "config.json")


@pytest.mark.parametrize("value, layers, pattern", [
    ("1", 3, (1, 1, 1)), ("2", 4, (1, 0, 1, 0)), ("[0]*1+[1]*3", 4, (0, 1, 1, 1)), ("[1, 0, 1]", 3, (1, 0, 1)),
])
def test_moe_layer_freq_reads_as_megatron_reads_it(value, layers, pattern):
    assert megatron_layer_pattern(value, layers) == pattern


def test_hfs_sparse_step_counts_layers_from_one():
    # Qwen-MoE's decoder_sparse_step 2: layers 1 and 3 have experts (Megatron's --moe-layer-freq 2 would be 0 and 2).
    assert moe_layer_pattern(4, 2, []) == (0, 1, 0, 1)
    assert moe_layer_pattern(4, 1, [0]) == (0, 1, 1, 1)


@pytest.mark.parametrize("flags, message", [
    (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size 2 with --tensor-model-parallel-size 1 "
                                             "needs --expert-model-parallel-size > 1"),
    (["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
     "do not split into expert tensor × expert × pipeline parallel groups of 2 × 2 × 1"),
])
def test_expert_layouts_megatron_would_get_wrong_fail_naming_the_flags(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_config(["--train-backend", "megatron", "--actor-num-gpus-per-node", "2", "--global-batch-size", "2",
                      *flags], **{"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl"})


@pytest.mark.parametrize("flags, said", [
    ({"moe-token-dispatcher-type": "flex"}, "--moe-token-dispatcher-type flex: the engine's MoE layers dispatch with "
                                            "alltoall or allgather"),
    ({"moe-router-dtype": "bf16"}, "--moe-router-dtype bf16: expected fp32 or fp64"),
    ({"moe-token-drop-policy": "random"}, "--moe-token-drop-policy random: expected probs or position"),
    ({"moe-token-dispatcher-type": "allgather", "expert-model-parallel-size": 2},
     "that dispatcher gathers equal blocks of tokens from every expert-parallel rank"),
])
def test_moe_run_settings_megatron_cannot_take_here_are_refused(flags, said):
    from vime_engine.train.megatron_layout import MegatronSetupError, ParallelLayout

    with pytest.raises(MegatronSetupError, match=re.escape(said)):
        ParallelLayout.from_flags(flags)


def test_resuming_across_expert_parallelisms_edge_is_refused_before_ray_starts(moe_dir, arithmetic_data, tmp_path):
    # megatron-core's optimizer state is one optimizer at EP 1 and a chained dense + expert pair above it: loading
    # one into the other failed deep in torch_dist with a KeyError, after every rank had built its model.
    from vime_engine.checkpoint import store as ckpt

    def cfg(ep: int, backend: str = "megatron"):
        return build_config(["--train-backend", backend, "--expert-model-parallel-size", str(ep),
                             "--actor-num-gpus-per-node", "2", "--global-batch-size", "2", "--input-key", "question",
                             "--label-key", "answer", "--save", str(tmp_path / "run")],
                            **{"hf-checkpoint": str(moe_dir), "prompt-data": str(arithmetic_data)})

    root = tmp_path / "run"
    ckpt.commit(root, ckpt.staging_dir(root, 0), 0, {"config": cfg(1).flat()}, keep_last=None)
    with pytest.raises(PreflightError, match=r"--save .*rollout_0000000 was saved by Megatron at "
                                             r"--expert-model-parallel-size 1 and this run asks for 2: .*resume at "
                                             r"--expert-model-parallel-size 1"):
        check_inputs(cfg(2))
    check_inputs(cfg(1))
    ckpt.commit(root, ckpt.staging_dir(root, 1), 1, {"config": cfg(2).flat()}, keep_last=None)
    check_inputs(cfg(2))
    with pytest.raises(PreflightError, match="saved by Megatron at --expert-model-parallel-size 2 and this run asks"):
        check_inputs(cfg(1))
