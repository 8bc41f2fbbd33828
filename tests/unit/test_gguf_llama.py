"""Our one-pass Llama GGUF conversion writes, byte for byte, the directory transformers' GGUF loading writes.

The oracle is transformers itself (`from_pretrained(..., gguf_file=...)`, then the fp32 save builtin.py did
before the one-pass converter). On SmolLM2-135M's own file it takes about 25 s (bench/gguf_convert.py compares
the two there, byte for byte, and times them); here both run on a small Llama GGUF written in that file's image:
its metadata (name, rope base, norm epsilon, tokenizer model and pre-tokenizer, special tokens, chat template),
the first 600 tokens of its vocabulary with the merges among them, and per tensor role the same storage
(Q8_0 embedding, Q4_1 matrices, F32 norms), with attention heads that differ from the key/value heads so the
attn_q / attn_k un-permutation is exercised.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vime_engine.models.builtin import _smollm2_gguf
from vime_engine.models.gguf_llama import convert_llama_gguf, convert_with_transformers

VOCAB = 600
SHAPE = dict(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2)


def _write_small_llama_gguf(path: Path) -> None:
    from gguf import GGMLQuantizationType as Q, GGUFWriter, TokenType
    from gguf.quants import quantize
    from transformers.integrations.gguf.reader import read_gguf_metadata

    real, _ = read_gguf_metadata(str(_smollm2_gguf()), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    tokens = real["tokenizer.ggml.tokens"][:VOCAB]
    kept = set(tokens)
    merges = [m for m in real["tokenizer.ggml.merges"]
              if {*m.split(" "), m.replace(" ", "")} <= kept]
    hidden, ffn, layers = SHAPE["hidden"], SHAPE["ffn"], SHAPE["layers"]
    w = GGUFWriter(str(path), "llama")
    w.add_name(real["general.name"])
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(SHAPE["heads"])
    w.add_head_count_kv(SHAPE["kv_heads"])
    w.add_rope_dimension_count(hidden // SHAPE["heads"])
    w.add_rope_freq_base(real["llama.rope.freq_base"])
    w.add_layer_norm_rms_eps(real["llama.attention.layer_norm_rms_epsilon"])
    w.add_vocab_size(VOCAB)
    w.add_file_type(real["general.file_type"])
    w.add_tokenizer_model(real["tokenizer.ggml.model"])
    w.add_tokenizer_pre(real["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if t.startswith("<") and t.endswith(">") else TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(real["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(real["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(real["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(real["tokenizer.ggml.padding_token_id"])
    w.add_add_space_prefix(real["tokenizer.ggml.add_space_prefix"])
    w.add_add_bos_token(real["tokenizer.ggml.add_bos_token"])
    w.add_chat_template(real["tokenizer.chat_template"])

    rng = np.random.default_rng(0)
    head_dim = hidden // SHAPE["heads"]

    def tensor(name: str, shape: tuple[int, ...], qtype) -> None:
        values = rng.normal(0, 0.05, shape).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, values)
        else:
            blocks = quantize(values, qtype)
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)

    tensor("token_embd.weight", (VOCAB, hidden), Q.Q8_0)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), Q.F32)
        tensor(f"blk.{i}.attn_q.weight", (hidden, hidden), Q.Q4_1)
        tensor(f"blk.{i}.attn_k.weight", (SHAPE["kv_heads"] * head_dim, hidden), Q.Q4_1)
        tensor(f"blk.{i}.attn_v.weight", (SHAPE["kv_heads"] * head_dim, hidden), Q.Q4_1)
        tensor(f"blk.{i}.attn_output.weight", (hidden, hidden), Q.Q4_1)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), Q.F32)
        tensor(f"blk.{i}.ffn_gate.weight", (ffn, hidden), Q.Q4_1)
        tensor(f"blk.{i}.ffn_up.weight", (ffn, hidden), Q.Q4_1)
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ffn), Q.Q4_1)
    tensor("output_norm.weight", (hidden,), Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def converted_both_ways(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf")
    gguf = root / "src" / "small-llama.Q4_1.gguf"
    gguf.parent.mkdir()
    _write_small_llama_gguf(gguf)
    convert_with_transformers(gguf, root / "transformers")
    convert_llama_gguf(gguf, root / "ours")
    return root / "transformers", root / "ours"


def test_the_directory_equals_transformers_conversion_byte_for_byte(converted_both_ways):
    theirs, ours = converted_both_ways
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    different = [p.name for p in theirs.iterdir() if p.read_bytes() != (ours / p.name).read_bytes()]
    assert different == []


def test_the_small_file_exercises_what_smollm2_needs(converted_both_ways):
    """The comparison above means something only if the small file has what SmolLM2's has: tied embeddings, grouped
    key/value heads, a real merge table, SmolLM2's chat template and special tokens."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    _, ours = converted_both_ways
    config = json.loads((ours / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    state = load_file(ours / "model.safetensors")
    assert "lm_head.weight" not in state and len(state) == 1 + 9 * SHAPE["layers"] + 1
    tokenizer = AutoTokenizer.from_pretrained(ours)
    assert tokenizer.eos_token == "<|im_end|>" and "SmolLM" in tokenizer.chat_template
    assert len(tokenizer("the answer is").input_ids) < len("the answer is")  # merges applied


def test_a_tensor_without_a_place_in_the_model_is_refused(tmp_path):
    from gguf import GGUFWriter

    from vime_engine.models.gguf_llama import gguf_config_dict

    # An architecture other than Llama is refused by name before any tensor is read.
    with pytest.raises(ValueError, match="'qwen2'"):
        gguf_config_dict({"general.architecture": "qwen2"}, ())
    path = tmp_path / "stray.gguf"
    w = GGUFWriter(str(path), "llama")
    for key, value in dict(context_length=64, embedding_length=32, feed_forward_length=64, block_count=1,
                           head_count=1, head_count_kv=1, vocab_size=4).items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("stray.weight", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'stray.weight' has no place"):
        convert_llama_gguf(path, tmp_path / "out")
