"""The engine's own HF ↔ Megatron mapping (vime_engine.train.megatron_hf): layouts worked by hand, the round trip
HF → Megatron → HF bit-exact, logits equal to transformers' in fp32 for each family (Llama untied, Qwen2 with
q/k/v biases, Qwen3 with q/k norms and tied embeddings, Qwen3-MoE with a dense and a MoE layer), and the same as
its counterpart through Megatron-Bridge (`--megatron-to-hf-mode bridge`): the same parameters loaded, the same HF
tensors exported."""

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


@pytest.mark.parametrize("mode", ["raw", "bridge"])
def test_weights_the_mapping_does_not_know_are_refused(tmp_path, single_process, mode):
    from safetensors.torch import save_file

    hf_dir, _ = _save(tmp_path, "qwen3")
    weights = load_file(hf_dir / "model.safetensors")
    save_file({**weights, "model.layers.0.self_attn.extra.weight": torch.ones(2)}, hf_dir / "model.safetensors")
    arch = HFArchitecture.from_pretrained(hf_dir)
    with pytest.raises(UnsupportedHFModel, match="does not use.*self_attn.extra.weight"):
        mm.build_model(arch, mm.ParallelLayout(), torch.float32, CPU, hf_dir=hf_dir,
                       mapping=mm.hf_mapping(mode, arch, hf_dir))


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


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3", "tiny_qwen3_moe"])
def test_bridge_mode_loads_and_exports_what_raw_mode_does(request, single_process, model_fixture):
    """--megatron-to-hf-mode bridge (Megatron-Bridge's AutoBridge) against raw (our mapping): HF weights loaded
    through the bridge are the very parameters ours loads, and the bridge's export of a model (trained away from the
    HF files) has the same HF names and values as ours, lm_head included only when asked (tied embeddings)."""
    from vime_engine.train.megatron_bridge import BridgeMapping

    hf_dir = request.getfixturevalue(model_fixture)
    arch = HFArchitecture.from_pretrained(hf_dir)
    raw, bridge = mm.hf_mapping("raw", arch, hf_dir), mm.hf_mapping("bridge", arch, hf_dir)
    assert isinstance(bridge, BridgeMapping)
    via_raw = mm.build_model(arch, mm.ParallelLayout(), torch.float32, CPU, hf_dir=hf_dir, mapping=raw)
    via_bridge = mm.build_model(arch, mm.ParallelLayout(), torch.float32, CPU, hf_dir=hf_dir, mapping=bridge)
    ours, theirs = dict(via_raw[0].named_parameters()), dict(via_bridge[0].named_parameters())
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours), "the bridge loaded other parameters"
    source = load_file(hf_dir / "model.safetensors")
    loaded = dict(mm.hf_weight_stream(arch, via_bridge, with_lm_head=False, mapping=raw))
    assert set(loaded) == set(source) and all(torch.equal(loaded[n], source[n]) for n in source)

    with torch.no_grad():  # as after training: the export must read the model, not echo the HF files
        for param in via_raw[0].parameters():
            param.add_(torch.randn_like(param) * 0.01)
    for with_lm_head in (True, False):
        by_raw = dict(mm.hf_weight_stream(arch, via_raw, with_lm_head, mapping=raw))
        by_bridge = dict(mm.hf_weight_stream(arch, via_raw, with_lm_head, mapping=bridge))
        assert set(by_bridge) == set(by_raw) == set(source) | ({"lm_head.weight"} if with_lm_head else set())
        assert all(torch.equal(by_bridge[n], by_raw[n]) for n in by_raw)
        assert not any(torch.equal(by_bridge[n], source[n]) for n in source)


def test_the_megatron_backend_takes_its_weights_in_and_out_through_the_bridge(tiny_qwen3_moe, single_process,
                                                                              tmp_path):
    """`--megatron-to-hf-mode bridge` in the Megatron backend: the initial weights come in through the bridge, and
    after a training step the weight sync's stream and --save-hf (through the bridge) hold what our mapping exports of
    the same trained model."""
    from tests.megatron.helpers import fixed_rollout, tiny_config
    from vime_engine.train.megatron_backend import MegatronTrainBackend
    from vime_engine.train.megatron_bridge import BridgeMapping

    backend = MegatronTrainBackend(tiny_config(tiny_qwen3_moe, megatron_to_hf_mode="bridge"))
    assert isinstance(backend.hf_mapping, BridgeMapping)
    source = load_file(tiny_qwen3_moe / "model.safetensors")
    start = dict(backend.named_weights())
    assert set(start) == set(source) | {"lm_head.weight"} and all(torch.equal(start[n], source[n]) for n in source)

    backend.train_rollout(fixed_rollout(backend.vocab_size))
    synced = dict(backend.named_weights())
    by_raw = dict(backend.mm.hf_weight_stream(backend.arch, backend.model, with_lm_head=True))
    assert set(synced) == set(by_raw) and all(torch.equal(synced[n], by_raw[n]) for n in by_raw)
    expert = "model.layers.1.mlp.experts.7.down_proj.weight"
    assert not torch.equal(synced[expert], source[expert])  # the experts trained, and the stream shows it
    saved = load_file(backend.save_hf(tmp_path / "hf") / "model.safetensors")
    assert set(saved) == set(source) and all(torch.equal(saved[n], by_raw[n]) for n in saved)
