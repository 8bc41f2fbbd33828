"""The bridge-free HF ↔ Megatron mapping (vime_engine.train.megatron_hf): layouts worked by hand, the round trip
HF → Megatron → HF bit-exact, logits equal to transformers' in fp32 for each family (Llama untied, Qwen2 with
q/k/v biases, Qwen3 with q/k norms and tied embeddings, Qwen3-MoE with a dense and a MoE layer), and the same layout
as Megatron-Bridge's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from vime_engine.devices.accelerator import CPU, prepare_accelerator
from vime_engine.train import megatron_model as mm
from vime_engine.train.megatron_hf import HFArchitecture, UnsupportedHFModel, hf_tensors, megatron_shard

SMALL = dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5)


def _arch(**overrides) -> HFArchitecture:
    values = dict(model_type="qwen3", vocab_size=5, hidden_size=2, ffn_hidden_size=4, num_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=1, norm_eps=1e-6, rope_theta=1e4, max_positions=8, tied_embeddings=True,
                  qkv_bias=False, qk_norm=True)
    return HFArchitecture(**{**values, **overrides})


def test_qkv_rows_are_grouped_per_query_group_and_split_by_group_over_tp():
    arch = _arch()  # 4 query heads in 2 groups, head_dim 1: one row per head
    q, k, v = torch.tensor([[0.0], [1], [2], [3]]), torch.tensor([[10.0], [11]]), torch.tensor([[20.0], [21]])
    full = megatron_shard("qkv", [q, k, v], arch, split_dim=None, rank=0, size=1)
    assert full.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]  # [q q k v] per group
    shards = [megatron_shard("qkv", [q, k, v], arch, split_dim=0, rank=r, size=2) for r in range(2)]
    assert shards[1].flatten().tolist() == [2, 3, 11, 21]  # rank 1 holds the second group whole
    back = hf_tensors("qkv", shards, arch, split_dim=0)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))


def test_fc1_holds_each_ranks_gate_slice_then_its_up_slice():
    gate, up = torch.arange(4.0).unsqueeze(1), torch.arange(10.0, 14.0).unsqueeze(1)
    shards = [megatron_shard("gate_up", [gate, up], _arch(), split_dim=0, rank=r, size=2) for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 10, 11], [2, 3, 12, 13]]
    back = hf_tensors("gate_up", shards, _arch(), split_dim=0)
    assert torch.equal(back[0], gate) and torch.equal(back[1], up)


def test_vocab_is_padded_to_the_tp_size_and_cut_on_export():
    embed = torch.arange(10.0).reshape(5, 2)
    shards = [megatron_shard("vocab", [embed], _arch(), split_dim=0, rank=r, size=2) for r in range(2)]
    assert [tuple(s.shape) for s in shards] == [(3, 2), (3, 2)] and shards[1][-1].abs().sum() == 0
    assert torch.equal(hf_tensors("vocab", shards, _arch(), split_dim=0)[0], embed)


def _save(tmp_path, family: str, **extra):
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[family]
    config = config_cls(**{**SMALL, **extra})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    for name, param in model.named_parameters():
        if "norm" in name:  # ones at init would hide a norm mapped to the wrong place
            param.data.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / family)
    return tmp_path / family, model


@pytest.fixture(scope="module")
def single_process():
    prepare_accelerator(CPU)  # as the backend and `vimeflow convert` do before building a model
    mm.init_distributed(CPU, mm.ParallelLayout(), seed=0)


@pytest.mark.parametrize("family, extra", [
    ("llama", {"tie_word_embeddings": False}),
    ("qwen2", {"tie_word_embeddings": False}),
    ("qwen3", {"tie_word_embeddings": True}),
    # Layer 0 dense (HF's decoder_sparse_step 2 puts experts in layer 1), the top-2 of 4 experts not renormalised:
    # Megatron's pre-softmax router.
    ("qwen3_moe", {"tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "decoder_sparse_step": 2, "norm_topk_prob": False}),
], ids=["llama-untied", "qwen2-qkv-bias", "qwen3-qk-norm-tied", "qwen3-moe-mixed-layers"])
def test_round_trip_is_exact_and_logits_match_transformers(tmp_path, single_process, family, extra):
    hf_dir, hf_model = _save(tmp_path, family, **extra)
    arch = HFArchitecture.from_pretrained(hf_dir)
    assert arch.qkv_bias == (family == "qwen2") and arch.qk_norm == family.startswith("qwen3")
    if family == "qwen3_moe":
        assert arch.moe.layer_pattern == (0, 1) and not arch.moe.renormalize
    model = mm.build_model(arch, mm.ParallelLayout(), torch.float32, CPU, hf_dir=hf_dir)

    exported = dict(mm.hf_weight_stream(arch, model, with_lm_head=True))
    source = load_file(hf_dir / "model.safetensors")
    assert set(exported) == set(source) | {"lm_head.weight"}
    assert all(torch.equal(exported[n], source[n]) for n in source), "round trip changed a tensor"
    assert torch.equal(exported["lm_head.weight"], hf_model.lm_head.weight)

    tokens = torch.randint(0, arch.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf_model(input_ids=tokens).logits
        ours = mm.forward_logits(model[0].eval(), tokens, arch.vocab_size)
    assert (reference - ours).abs().max().item() < 1e-5


def test_weights_the_mapping_does_not_know_are_refused(tmp_path, single_process):
    from safetensors.torch import save_file

    hf_dir, _ = _save(tmp_path, "qwen3")
    weights = load_file(hf_dir / "model.safetensors")
    save_file({**weights, "model.layers.0.self_attn.extra.weight": torch.ones(2)}, hf_dir / "model.safetensors")
    arch = HFArchitecture.from_pretrained(hf_dir)
    with pytest.raises(UnsupportedHFModel, match="does not use.*self_attn.extra.weight"):
        mm.build_model(arch, mm.ParallelLayout(), torch.float32, CPU, hf_dir=hf_dir)


def test_configs_it_would_get_wrong_are_refused_by_field():
    import transformers

    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(UnsupportedHFModel, match="rope scaling"):
        HFArchitecture.from_hf_config(transformers.LlamaConfig(**SMALL, rope_parameters=llama3_rope))
    with pytest.raises(UnsupportedHFModel, match="attention_bias"):
        HFArchitecture.from_hf_config(transformers.LlamaConfig(**SMALL, attention_bias=True))
    with pytest.raises(UnsupportedHFModel, match="model_type 'gpt2'"):
        HFArchitecture.from_hf_config(transformers.GPT2Config())


def test_layout_is_megatron_bridges(tiny_qwen3, single_process):
    """Megatron-Bridge (where installed: the 3.12 lane) reads our Megatron model back into the same HF tensors,
    so torch_dist checkpoints written through either carry the same layout."""
    from tests.megatron.bridge_import import import_megatron_bridge

    AutoBridge = import_megatron_bridge().AutoBridge

    arch = HFArchitecture.from_pretrained(tiny_qwen3)
    model = mm.build_model(arch, mm.ParallelLayout(), torch.float32, CPU, hf_dir=tiny_qwen3)
    source = load_file(tiny_qwen3 / "model.safetensors")
    bridge = AutoBridge.from_hf_pretrained(str(tiny_qwen3), dtype=torch.float32)
    via_bridge = dict(bridge.export_hf_weights(model, cpu=True, show_progress=False))
    assert set(via_bridge) - {"lm_head.weight"} == set(source)
    assert all(torch.equal(via_bridge[n], source[n]) for n in source)
