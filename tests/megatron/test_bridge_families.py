"""The families the engine's own mapping lacks (megatron_hf.BRIDGE_FAMILIES), built by Megatron-Bridge's model provider
under `--megatron-to-hf-mode bridge`: builtin://tiny-deepseek-v3 (multi-latent attention, sigmoid routing with an
expert bias, 2 expert groups of which 1 is kept, a shared expert, a dense first layer) trained by MegatronTrainBackend
against the torch backend running transformers' DeepseekV3ForCausalLM on the same weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

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


def test_deepseek_v3_through_the_bridge_trains_as_transformers_does(tiny_deepseek_v3_mtp, tmp_path):
    """Log-probs on a fixed rollout and one training step's losses and gradient norm within the fp32 bound of the
    torch backend (transformers' DeepseekV3ForCausalLM); the step moves the weights, the weight sync's stream and
    --save-hf give back transformers' names and shapes, and the saved directory loads in transformers. The checkpoint
    ships a multi-token-prediction layer, which neither backend builds: the sync leaves it out and --save-hf carries it
    unchanged."""
    model_config = json.loads((tiny_deepseek_v3_mtp / "config.json").read_text())
    dims = {"hidden_size": model_config["hidden_size"], "num_layers": model_config["num_hidden_layers"]}
    # vime's DeepSeek-V3 script keeps the expert bias still in RL (--moe-router-bias-update-rate 0), as the torch
    # backend does; Megatron's default would move it after every step.
    cfg = tiny_config(tiny_deepseek_v3_mtp, megatron_to_hf_mode="bridge", **{"moe-router-bias-update-rate": 0})
    megatron, reference = MegatronTrainBackend(cfg), TorchTrainBackend(cfg)
    assert megatron.arch.built_by_bridge and megatron.arch.mtp_layers == 1
    assert megatron.mm.unwrap(megatron.model[0]).mtp_process is False  # no MTP block built
    assert megatron.mm.unwrap(megatron.model[0]).config.moe_router_bias_update_rate == 0
    samples = fixed_rollout(megatron.vocab_size)
    assert_fp32_close(megatron.log_probs(samples), reference.log_probs(samples), **dims)

    source = load_file(tiny_deepseek_v3_mtp / "model.safetensors")
    mtp = {n for n in source if n.startswith("model.layers.2.")}
    assert len(mtp) == 32
    metrics, expected = megatron.train_rollout(samples), reference.train_rollout(samples)
    for key in ("train/pg_loss", "train/ppo_kl", "train/entropy_loss", "train/grad_norm"):
        bound = fp32_tolerance(expected[key], dims["hidden_size"], model_depth(dims["num_layers"]))
        assert abs(metrics[key] - expected[key]) <= bound, key

    trained = {name: tensor.clone() for name, tensor in megatron.named_weights()}
    torch_state = dict(reference.named_weights())
    assert {n: tuple(t.shape) for n, t in trained.items()} == {n: tuple(t.shape) for n, t in source.items()
                                                               if n not in mtp}
    assert set(trained) == set(source) - mtp  # untied: lm_head.weight is a weight of its own; the sync sends no MTP
    for name in ("model.layers.0.self_attn.kv_b_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight",
                 "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.gate.weight"):
        assert (trained[name] - source[name]).abs().max() > 1e-4, name  # lr 1e-3: Adam moved it
    # Adam's first step moves a weight by about lr whatever its gradient's size: the two backends' weights agree to a
    # small fraction of that step (as for the tiny Qwen3 in test_backend.py).
    assert max((trained[n] - torch_state[n]).abs().max().item() for n in torch_state if n in trained) < 5e-5

    saved = megatron.save_hf(tmp_path / "hf")
    written = load_file(saved / "model.safetensors")
    assert set(written) == set(source)
    assert all(torch.equal(written[n], trained[n] if n in trained else source[n]) for n in written)
    assert json.loads((saved / "config.json").read_text())["num_nextn_predict_layers"] == 1
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, output_loading_info=True)
    # transformers builds no MTP layer (it ignores only DeepSeek-V3's own layer 61): those tensors, named as it fuses a
    # layer's experts, are unexpected to it, and only those
    unexpected = info.pop("unexpected_keys")
    assert unexpected and all(n.startswith("model.layers.2.") for n in unexpected), unexpected
    assert not any(info.values()), info


def test_mtp_layers_are_left_out_of_the_policy_and_nothing_else_is(tiny_deepseek_v3, tiny_deepseek_v3_mtp, tmp_path,
                                                                    caplog):
    """The checkpoint with an MTP layer builds the model the one without builds, to the same logits bit for bit (the
    same base weights), saying once that the layer is skipped; a non-MTP tensor missing from it, or one beyond the MTP
    layers, still stops the load."""
    from vime_engine.devices.accelerator import CPU, prepare_accelerator
    from vime_engine.train import megatron_model as mm
    from vime_engine.train.megatron_mtp import say_mtp_skipped

    prepare_accelerator(CPU)
    mm.init_distributed(CPU, mm.ParallelLayout(), seed=0)
    say_mtp_skipped.cache_clear()  # said once a process: an earlier test may have loaded the checkpoint

    def build(hf_dir):
        arch = HFArchitecture.from_pretrained(hf_dir, bridge=True)
        return mm.build_model(arch, mm.ParallelLayout(), torch.float32, CPU, hf_dir=hf_dir,
                              mapping=mm.hf_mapping("bridge", arch, hf_dir))[0].eval()

    vocab = json.loads((tiny_deepseek_v3_mtp / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), caplog.at_level("WARNING", logger="vime_engine.train.megatron_mtp"):
        plain = mm.forward_logits(build(tiny_deepseek_v3), tokens, vocab)
        with_mtp = build(tiny_deepseek_v3_mtp)
        assert not any(name.startswith("mtp.") for name, _ in with_mtp.named_parameters())
        assert torch.equal(mm.forward_logits(with_mtp, tokens, vocab), plain)
        build(tiny_deepseek_v3_mtp)
    said = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(said) == 1 and "1 multi-token-prediction layer" in said[0] and "--mtp-num-layers" in said[0]

    source = load_file(tiny_deepseek_v3_mtp / "model.safetensors")
    beyond = source["model.layers.2.enorm.weight"].clone()
    for damage, refused in [
        ({"model.layers.1.mlp.experts.3.down_proj.weight": None}, r"maps no HF tensor.*local_experts\.3"),
        ({"model.layers.3.enorm.weight": beyond}, r"does not use.*model\.layers\.3"),
    ]:
        damaged = tmp_path / f"damaged-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_deepseek_v3_mtp, damaged)
        tensors = {n: t for n, t in {**source, **damage}.items() if t is not None}
        save_file(tensors, str(damaged / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(UnsupportedHFModel, match=refused):
            build(damaged)


def test_glm45_stops_where_its_bridge_maps_no_local_experts(tmp_path):
    """GLM-4.5 through the bridge on this lane (no Transformer Engine): Megatron-Bridge 0.6.2 maps its routed experts
    only as TE's grouped experts, so the local layers' experts would keep their random init; refused, naming them
    (with an MTP layer declared, as GLM-4.5's checkpoints do, which is left out of the model and changes nothing)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from vime_engine.devices.accelerator import CPU, prepare_accelerator
    from vime_engine.train import megatron_model as mm

    prepare_accelerator(CPU)  # as the backend does before building a model
    mm.init_distributed(CPU, mm.ParallelLayout(), seed=0)

    config = Glm4MoeConfig(
        vocab_size=301, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True, use_qk_norm=True,
        attention_bias=True, partial_rotary_factor=0.5, tie_word_embeddings=False, num_nextn_predict_layers=1)
    Glm4MoeForCausalLM(config).save_pretrained(tmp_path / "glm")
    arch = HFArchitecture.from_pretrained(tmp_path / "glm", bridge=True)
    assert arch.built_by_bridge and arch.moe.layer_pattern == (0, 1)
    with pytest.raises(UnsupportedHFModel, match=r"local_experts\.0\.linear_fc1.*TE's grouped layout"):
        mm.build_model(arch, mm.ParallelLayout(), torch.float32, CPU, hf_dir=tmp_path / "glm",
                       mapping=mm.hf_mapping("bridge", arch, tmp_path / "glm"))
