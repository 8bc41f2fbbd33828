"""vime's model-architecture flags are checked against config.json, never applied over it."""

from __future__ import annotations

import json
import re

import pytest

from vime_engine.config import parse_flags
from vime_engine.config.megatron_flags import typed_megatron_value
from vime_engine.train.megatron_model_flags import MODEL_FLAGS, ModelFlagMismatch, check_model_flags

# vime's scripts/models/qwen3-4B.sh, as a user's launch script passes it (our own transcription of its flags).
QWEN3_4B_FLAGS = [
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "5000000", "--vocab-size", "151936", "--kv-channels", "128",
    "--qk-layernorm",
]
# The config.json fields of a Qwen3-4B (Instruct-2507) checkpoint that those flags describe.
QWEN3_4B_CONFIG = {
    "model_type": "qwen3", "hidden_act": "silu", "num_hidden_layers": 36, "hidden_size": 2560,
    "intermediate_size": 9728, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 5000000, "vocab_size": 151936, "tie_word_embeddings": True,
    "attention_bias": False, "max_position_embeddings": 262144,
}
# The same flags for the built-in tiny Qwen3 (vime_engine/models/builtin.py): 2 layers, hidden 128, 4 heads, 2 kv heads.
TINY_QWEN3_MODEL_FLAGS = [
    "--swiglu", "--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--use-rotary-position-embeddings", "--disable-bias-linear",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base", "10000", "--vocab-size", "434",
    "--kv-channels", "32", "--qk-layernorm",
]
# vime's scripts/models/qwen2.5-1.5B.sh and the fields of that model.
QWEN25_FLAGS = [
    "--swiglu", "--num-layers", "28", "--hidden-size", "1536", "--ffn-hidden-size", "8960",
    "--num-attention-heads", "12", "--use-rotary-position-embeddings", "--disable-bias-linear", "--add-qkv-bias",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--rotary-base", "10000", "--group-query-attention",
    "--num-query-groups", "2", "--vocab-size", "151936",
]
QWEN25_CONFIG = {
    "model_type": "qwen2", "hidden_act": "silu", "num_hidden_layers": 28, "hidden_size": 1536,
    "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "vocab_size": 151936, "tie_word_embeddings": True,
}


def _check(argv: list[str], config: dict) -> None:
    flags = {name: typed_megatron_value(name, value) for name, value in parse_flags(argv).items()}
    check_model_flags(flags, config, "model/config.json")


def test_every_model_flag_of_vimes_scripts_is_accepted_and_agrees():
    assert {a[2:] for a in QWEN3_4B_FLAGS + QWEN25_FLAGS if a.startswith("--")} <= set(MODEL_FLAGS)
    _check(QWEN3_4B_FLAGS, QWEN3_4B_CONFIG)
    _check(QWEN25_FLAGS, QWEN25_CONFIG)


@pytest.mark.parametrize("flags, config, said", [
    (["--num-layers", "3"], QWEN3_4B_CONFIG, "--num-layers 3 disagrees with config.json num_hidden_layers = 36"),
    (["--rotary-base", "1000000"], QWEN3_4B_CONFIG, "config.json rope_theta = 5000000.0"),
    (["--kv-channels", "64"], QWEN3_4B_CONFIG, "head_dim = 128"),
    (["--norm-epsilon", "1e-5"], QWEN3_4B_CONFIG, "rms_norm_eps = 1e-06"),
    (["--group-query-attention", "--num-query-groups", "4"], QWEN3_4B_CONFIG, "num_key_value_heads = 8"),
    (["--num-query-groups", "8"], QWEN3_4B_CONFIG, "no --group-query-attention (one group per head) gives 32"),
    (["--untie-embeddings-and-output-weights"], QWEN3_4B_CONFIG, "tie_word_embeddings"),
    (["--qk-layernorm"], QWEN25_CONFIG, "the model does not have it"),
    (["--disable-bias-linear"], {**QWEN3_4B_CONFIG, "attention_bias": True}, "attention_bias / mlp_bias"),
    (["--add-qkv-bias"], QWEN3_4B_CONFIG, "q/k/v projection biases"),
    (["--normalization", "LayerNorm"], QWEN3_4B_CONFIG, "RMSNorm models only"),
    (["--position-embedding-type", "learned_absolute"], QWEN3_4B_CONFIG, "learned absolute positions"),
])
def test_a_flag_that_does_not_describe_the_model_is_refused_naming_both(flags, config, said):
    with pytest.raises(ModelFlagMismatch, match="--") as refused:
        _check(flags, config)
    assert said in str(refused.value)


def test_a_rope_theta_under_rope_parameters_counts_like_a_top_level_one():
    config = {**QWEN3_4B_CONFIG, "rope_parameters": {"rope_theta": 5000000.0, "rope_type": "default"}}
    del config["rope_theta"]
    _check(["--rotary-base", "5000000"], config)


def test_the_tiny_models_flags_describe_it(tiny_model):
    _check(TINY_QWEN3_MODEL_FLAGS, json.loads((tiny_model / "config.json").read_text()))
    with pytest.raises(ModelFlagMismatch, match="--num-layers 3 disagrees with config.json num_hidden_layers = 2"):
        _check(["--num-layers", "3"], json.loads((tiny_model / "config.json").read_text()))


# vime's scripts/models/deepseek-v3.sh (our transcription of its flags) with builtin://tiny-deepseek-v3's sizes: every
# flag describes the model (checked against config.json) or says how Megatron runs it.
TINY_DEEPSEEK_V3_FLAGS = [
    "--disable-bias-linear", "--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256",
    "--num-attention-heads", "4", "--kv-channels", "32", "--normalization", "RMSNorm", "--position-embedding-type",
    "rope", "--norm-epsilon", "1e-6", "--swiglu", "--untie-embeddings-and-output-weights", "--vocab-size", "434",
    "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "512", "--qk-head-dim", "32",
    "--qk-pos-emb-head-dim", "64", "--v-head-dim", "32", "--qk-layernorm", "--rotary-base", "10000",
    "--mscale", "1.0", "--mscale-all-dim", "0", "--attention-softmax-in-fp32", "--no-rope-fusion",
    "--num-experts", "4", "--moe-layer-freq", "[0, 1]", "--moe-ffn-hidden-size", "64", "--moe-router-topk", "2",
    "--moe-shared-expert-intermediate-size", "64", "--moe-router-pre-softmax", "--moe-router-score-function",
    "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type", "seq_aux_loss",
    "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0", "--moe-router-bias-update-rate", "0",
    "--moe-router-group-topk", "1", "--moe-router-num-groups", "2", "--moe-grouped-gemm",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    "--mtp-num-layers", "0",
]


@pytest.fixture(scope="module")
def tiny_deepseek_v3(tmp_path_factory):
    from vime_engine.models.builtin import materialize_builtin_model

    return materialize_builtin_model("tiny-deepseek-v3", tmp_path_factory.mktemp("dsv3") / "model")


def test_vimes_deepseek_v3_flags_describe_the_tiny_deepseek_v3(tiny_deepseek_v3):
    from vime_engine.train.megatron_layout import ParallelLayout

    config = json.loads((tiny_deepseek_v3 / "config.json").read_text())
    flags = {name: typed_megatron_value(name, value) for name, value in parse_flags(TINY_DEEPSEEK_V3_FLAGS).items()}
    check_model_flags(flags, config, "model/config.json")
    layout = ParallelLayout.from_flags(flags)
    assert layout.moe.expert_bias_update_rate == 0 and not layout.rope_fusion  # they reach the provider / config


@pytest.mark.parametrize("flags, said", [
    ({"kv-lora-rank": 64}, "--kv-lora-rank 64 disagrees with config.json kv_lora_rank = 512"),
    ({"qk-pos-emb-head-dim": 32}, "qk_rope_head_dim = 64"),
    ({"moe-router-group-topk": 2}, "topk_group = 1"),
    ({"moe-router-score-function": "softmax"}, "sigmoid"),
    ({"moe-shared-expert-intermediate-size": 128}, "= 64"),
    ({"moe-layer-freq": "1"}, "gives the MoE layers all 2"),
    ({"mtp-num-layers": 1}, "num_nextn_predict_layers = 0"),
    ({"kv-channels": 16}, "v_head_dim (multi-latent attention) = 32"),
    ({"mscale": 0.707}, "rope_scaling.mscale"),
])
def test_a_deepseek_v3_flag_that_does_not_describe_it_is_refused(tiny_deepseek_v3, flags, said):
    config = json.loads((tiny_deepseek_v3 / "config.json").read_text())
    with pytest.raises(ModelFlagMismatch, match=re.escape(said)):
        check_model_flags(flags, config, "model/config.json")


def test_mtp_layers_are_left_out_without_the_flag_and_training_them_is_refused(tiny_deepseek_v3):
    # DeepSeek-V3's and GLM-4.5's checkpoints ship one MTP layer: 0 (vime's scripts) or no flag leaves it out of the
    # policy, as slime does; asking to train it stops before Ray starts, saying how to go on; another count disagrees.
    config = {**json.loads((tiny_deepseek_v3 / "config.json").read_text()), "num_nextn_predict_layers": 1}
    check_model_flags({"mtp-num-layers": 0}, config, "c")
    check_model_flags({}, config, "c")
    with pytest.raises(ModelFlagMismatch, match=r"--mtp-num-layers 1: training the checkpoint's 1 "
                                                r"multi-token-prediction layer\(s\) is not wired .* drop the flag: "
                                                r".* carry their weights"):
        check_model_flags({"mtp-num-layers": 1}, config, "c")
    with pytest.raises(ModelFlagMismatch, match="--mtp-num-layers 2 disagrees with config.json "
                                                "num_nextn_predict_layers = 1"):
        check_model_flags({"mtp-num-layers": 2}, config, "c")


def test_a_load_balancing_loss_other_than_the_one_built_passes_only_unweighted(tiny_deepseek_v3):
    config = json.loads((tiny_deepseek_v3 / "config.json").read_text())
    check_model_flags({"moe-router-load-balancing-type": "seq_aux_loss"}, config, "c", aux_loss_coeff=0.0)
    with pytest.raises(ModelFlagMismatch, match="--moe-router-load-balancing-type seq_aux_loss: every backend adds"):
        check_model_flags({"moe-router-load-balancing-type": "seq_aux_loss"}, config, "c", aux_loss_coeff=0.01)
