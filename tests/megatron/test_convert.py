"""HF <-> Megatron torch_dist conversion: round trips, idempotence, failure on damage, and the raw and bridge modes
(`--megatron-to-hf-mode`) reading each other's checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from vime_engine.convert import MARKER, convert_checkpoint


def _round_trip(hf_dir, tmp_path):
    to_megatron = convert_checkpoint(hf_dir, tmp_path / "megatron", "hf_to_megatron")
    back = convert_checkpoint(tmp_path / "megatron", tmp_path / "hf", "megatron_to_hf")
    return to_megatron, back


def _assert_same_tensors(a_dir, b_dir):
    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    for name in a:
        if name == "lm_head.weight" and name not in b:
            continue  # tied embeddings: HF drops the alias when saving
        assert torch.equal(a[name], b[name]), name


def test_tiny_qwen3_round_trip_is_exact_and_idempotent(tiny_qwen3, tmp_path):
    to_megatron, back = _round_trip(tiny_qwen3, tmp_path)
    assert not to_megatron.skipped and not back.skipped
    assert (tmp_path / "megatron" / "iter_0000000" / "metadata.json").is_file()
    assert (tmp_path / "megatron" / "hf_config" / "tokenizer.json").is_file()
    assert to_megatron.max_tensor_abs_diff == 0.0 and back.max_tensor_abs_diff == 0.0
    assert to_megatron.max_logprob_abs_diff <= 1e-5 and back.max_logprob_abs_diff <= 1e-5
    _assert_same_tensors(tiny_qwen3, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (tiny_qwen3 / "tokenizer.json").read_text()

    again = convert_checkpoint(tiny_qwen3, tmp_path / "megatron", "hf_to_megatron")
    assert again.skipped and again.source_hash == to_megatron.source_hash


def test_changed_source_reconverts_and_wrong_input_is_named(tiny_qwen3, tmp_path):
    first = convert_checkpoint(tiny_qwen3, tmp_path / "megatron", "hf_to_megatron")
    marker = json.loads((tmp_path / "megatron" / MARKER).read_text())
    marker["source_hash"] = "0" * 64  # as if the HF model had changed since
    (tmp_path / "megatron" / MARKER).write_text(json.dumps(marker))
    redone = convert_checkpoint(tiny_qwen3, tmp_path / "megatron", "hf_to_megatron")
    assert not redone.skipped and redone.source_hash == first.source_hash

    with pytest.raises(FileNotFoundError, match="not a converted Megatron checkpoint"):
        convert_checkpoint(tiny_qwen3, tmp_path / "hf", "megatron_to_hf")
    assert not (tmp_path / "hf").exists()


def test_tiny_moe_round_trip_is_exact(tiny_qwen3_moe, tmp_path):
    # Every expert and router through torch_dist and back (transformers keeps them fused in memory, one tensor per
    # expert in its files: the conversion checks the files' names).
    to_megatron, back = _round_trip(tiny_qwen3_moe, tmp_path)
    assert to_megatron.max_tensor_abs_diff == 0.0 and back.max_tensor_abs_diff == 0.0
    assert to_megatron.max_logprob_abs_diff <= 1e-5 and back.max_logprob_abs_diff <= 1e-5
    _assert_same_tensors(tiny_qwen3_moe, tmp_path / "hf")
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in load_file(tmp_path / "hf" / "model.safetensors")


def test_smollm2_llama_round_trip(tmp_path_factory, tmp_path):
    from vime_engine.models.builtin import materialize_builtin_model

    hf_dir = materialize_builtin_model("smollm2-135m-instruct", tmp_path_factory.mktemp("models") / "smollm2")
    to_megatron, back = _round_trip(hf_dir, tmp_path)
    assert to_megatron.max_tensor_abs_diff == 0.0 and back.max_tensor_abs_diff == 0.0
    assert to_megatron.max_logprob_abs_diff <= 1e-5 and back.max_logprob_abs_diff <= 1e-5
    _assert_same_tensors(hf_dir, tmp_path / "hf")


def test_bridge_and_raw_conversions_read_each_others_checkpoints(tiny_qwen3_moe, tmp_path):
    # HF -> torch_dist through Megatron-Bridge, back through our mapping, and the other way round: the experts and
    # routers land where the other mode looks for them, so the way back is the source, bit for bit.
    by_bridge = convert_checkpoint(tiny_qwen3_moe, tmp_path / "bridge-megatron", "hf_to_megatron", mode="bridge")
    back_raw = convert_checkpoint(tmp_path / "bridge-megatron", tmp_path / "raw-hf", "megatron_to_hf", mode="raw")
    by_raw = convert_checkpoint(tiny_qwen3_moe, tmp_path / "raw-megatron", "hf_to_megatron", mode="raw")
    back_bridge = convert_checkpoint(tmp_path / "raw-megatron", tmp_path / "bridge-hf", "megatron_to_hf", mode="bridge")
    for result in (by_bridge, back_raw, by_raw, back_bridge):
        assert result.max_tensor_abs_diff == 0.0 and result.max_logprob_abs_diff <= 1e-5
    assert json.loads((tmp_path / "bridge-megatron" / MARKER).read_text())["megatron_to_hf_mode"] == "bridge"
    _assert_same_tensors(tiny_qwen3_moe, tmp_path / "raw-hf")
    _assert_same_tensors(tiny_qwen3_moe, tmp_path / "bridge-hf")


def test_a_family_only_the_bridge_builds_converts_through_it_exactly(tiny_deepseek_v3_mtp, tmp_path):
    """builtin://tiny-deepseek-v3-mtp HF → torch_dist → HF in bridge mode gives back every tensor (the expert bias,
    a buffer in Megatron, included) bit for bit: its multi-token-prediction layer, which the Megatron model does not
    hold, waits beside the torch_dist weights and is carried back unchanged (without that file the way back is refused).
    Raw mode refuses it naming bridge mode."""
    from vime_engine.train.megatron_hf import UnsupportedHFModel
    from vime_engine.train.megatron_mtp import MTP_TENSORS_FILE

    source_dir = tiny_deepseek_v3_mtp
    to_megatron = convert_checkpoint(source_dir, tmp_path / "megatron", "hf_to_megatron", mode="bridge")
    back = convert_checkpoint(tmp_path / "megatron", tmp_path / "hf", "megatron_to_hf", mode="bridge")
    assert to_megatron.max_tensor_abs_diff == 0.0 and back.max_tensor_abs_diff == 0.0
    assert back.max_logprob_abs_diff <= 1e-5
    source, written = load_file(source_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(source) == set(written) and all(torch.equal(source[n], written[n]) for n in source)
    kept = load_file(tmp_path / "megatron" / MTP_TENSORS_FILE)
    assert set(kept) == {n for n in source if n.startswith("model.layers.2.")} and len(kept) == 32
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    (tmp_path / "megatron" / MTP_TENSORS_FILE).unlink()  # the way back would lose the MTP layer: refused, named
    with pytest.raises(FileNotFoundError, match=f"{MTP_TENSORS_FILE}: missing; .* 1 multi-token-prediction layer"):
        convert_checkpoint(tmp_path / "megatron", tmp_path / "hf-without", "megatron_to_hf", mode="bridge")
    assert not (tmp_path / "hf-without").exists()
    with pytest.raises(UnsupportedHFModel, match="use --megatron-to-hf-mode bridge"):
        convert_checkpoint(source_dir, tmp_path / "raw", "hf_to_megatron")
