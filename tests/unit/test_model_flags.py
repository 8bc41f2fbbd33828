"""vime's model-architecture flags are checked against config.json, never applied over it."""

from __future__ import annotations

import json

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
