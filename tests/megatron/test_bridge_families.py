"""The families the engine's own mapping lacks (megatron_hf.BRIDGE_FAMILIES), built by Megatron-Bridge's model provider
under `--megatron-to-hf-mode bridge`: builtin://tiny-deepseek-v3 (multi-latent attention, sigmoid routing with an
expert bias, 2 expert groups of which 1 is kept, a shared expert, a dense first layer) trained by MegatronTrainBackend
against the torch backend running transformers' DeepseekV3ForCausalLM on the same weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.megatron.helpers import fixed_rollout, tiny_config
from tests.support.tolerance import assert_fp32_close, fp32_tolerance, model_depth
from vime_engine.train.megatron_backend import MegatronTrainBackend
from vime_engine.train.megatron_hf import HFArchitecture, UnsupportedHFModel
from vime_engine.train.torch_backend import TorchTrainBackend


def test_raw_mode_refuses_a_family_only_the_bridge_builds(tiny_deepseek_v3):
    with pytest.raises(UnsupportedHFModel, match="deepseek_v3.*use --megatron-to-hf-mode bridge"):
        HFArchitecture.from_pretrained(tiny_deepseek_v3)
    arch = HFArchitecture.from_pretrained(tiny_deepseek_v3, bridge=True)
    assert arch.built_by_bridge and arch.moe.layer_pattern == (0, 1) and arch.moe.num_experts == 4


def test_deepseek_v3_through_the_bridge_trains_as_transformers_does(tiny_deepseek_v3, tmp_path):
    """Log-probs on a fixed rollout and one training step's losses and gradient norm within the fp32 bound of the
    torch backend (transformers' DeepseekV3ForCausalLM); the step moves the weights, the weight sync's stream and
    --save-hf give back transformers' names and shapes, and the saved directory loads in transformers."""
    model_config = json.loads((tiny_deepseek_v3 / "config.json").read_text())
    dims = {"hidden_size": model_config["hidden_size"], "num_layers": model_config["num_hidden_layers"]}
    # vime's DeepSeek-V3 script keeps the expert bias still in RL (--moe-router-bias-update-rate 0), as the torch
    # backend does; Megatron's default would move it after every step.
    cfg = tiny_config(tiny_deepseek_v3, megatron_to_hf_mode="bridge", **{"moe-router-bias-update-rate": 0})
    megatron, reference = MegatronTrainBackend(cfg), TorchTrainBackend(cfg)
    assert megatron.arch.built_by_bridge
    assert megatron.mm.unwrap(megatron.model[0]).config.moe_router_bias_update_rate == 0
    samples = fixed_rollout(megatron.vocab_size)
    assert_fp32_close(megatron.log_probs(samples), reference.log_probs(samples), **dims)

    source = load_file(tiny_deepseek_v3 / "model.safetensors")
    metrics, expected = megatron.train_rollout(samples), reference.train_rollout(samples)
    for key in ("train/pg_loss", "train/ppo_kl", "train/entropy_loss", "train/grad_norm"):
        bound = fp32_tolerance(expected[key], dims["hidden_size"], model_depth(dims["num_layers"]))
        assert abs(metrics[key] - expected[key]) <= bound, key

    trained = {name: tensor.clone() for name, tensor in megatron.named_weights()}
    torch_state = dict(reference.named_weights())
    assert {n: tuple(t.shape) for n, t in trained.items() if n in source} == {n: tuple(t.shape)
                                                                               for n, t in source.items()}
    assert set(trained) == set(source)  # untied: lm_head.weight is a weight of its own
    for name in ("model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight",
                 "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.gate.weight"):
        assert (trained[name] - source[name]).abs().max() > 1e-4, name  # lr 1e-3: Adam moved it
    # Adam's first step moves a weight by about lr whatever its gradient's size: the two backends' weights agree to a
    # small fraction of that step (as for the tiny Qwen3 in test_backend.py).
    assert max((trained[n] - torch_state[n]).abs().max().item() for n in torch_state if n in trained) < 5e-5

    saved = megatron.save_hf(tmp_path / "hf")
    written = load_file(saved / "model.safetensors")
    assert set(written) == set(source) and all(torch.equal(written[n], trained[n]) for n in written)
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no tensor missing, unexpected or mismatched


def test_glm45_stops_where_its_bridge_maps_no_local_experts(tmp_path):
    """GLM-4.5 through the bridge on this lane (no Transformer Engine): Megatron-Bridge 0.6.2 maps its routed experts
    only as TE's grouped experts, so the local layers' experts would keep their random init; refused, naming them."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from vime_engine.devices.accelerator import CPU, prepare_accelerator
    from vime_engine.train import megatron_model as mm

    prepare_accelerator(CPU)  # as the backend does before building a model
    mm.init_distributed(CPU, mm.ParallelLayout(), seed=0)

    config = Glm4MoeConfig(
        vocab_size=301, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, use_qk_norm=True,
        attention_bias=True, partial_rotary_factor=0.5, tie_word_embeddings=False, num_nextn_predict_layers=0)
    Glm4MoeForCausalLM(config).save_pretrained(tmp_path / "glm")
    arch = HFArchitecture.from_pretrained(tmp_path / "glm", bridge=True)
    assert arch.built_by_bridge and arch.moe.layer_pattern == (0, 1)
    with pytest.raises(UnsupportedHFModel, match=r"local_experts\.0\.linear_fc1.*TE's grouped layout"):
        mm.build_model(arch, mm.ParallelLayout(), torch.float32, CPU, hf_dir=tmp_path / "glm",
                       mapping=mm.hf_mapping("bridge", arch, tmp_path / "glm"))
