"""A Llama GGUF file as an fp32 HF directory, in one pass over the file.

transformers' own GGUF loading (`from_pretrained(..., gguf_file=...)`) writes the same directory but parses the
file's metadata with gguf-py three times (config, model, tokenizer's config: about 4 s each for a 49k-token
vocabulary) and rebuilds gguf-py's tensor-name table once per submodule (397 times for SmolLM2-135M): 24 s for a
135M model, where this takes a few. The steps are transformers' own, called once each:

- metadata: transformers' fast GGUF reader (the one its tokenizer path uses), read once;
- config: the GGUF keys renamed by transformers' GGUF_TO_TRANSFORMERS_MAPPING, as `load_gguf_checkpoint` does;
- tensors: dequantized by gguf-py (what `load_gguf_checkpoint` calls), attn_q / attn_k un-permuted by
  transformers' LlamaTensorProcessor, renamed through gguf-py's name table for the model's parameters;
- tokenizer: transformers' GGUF tokenizer conversion, in the class its AutoTokenizer picks for such a file.

Invariant (tests/unit/test_gguf_llama.py): the directory equals the one transformers' GGUF loading writes
(`convert_with_transformers`), byte for byte (config, generation config, safetensors, tokenizer files). A
transformers without that fast reader (`transformers.integrations.gguf`, absent from 5.12, the Megatron lane's)
converts with `convert_with_transformers` itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

# The GGUF architecture this converter reads; others are refused (their tensor processors differ).
LLAMA = "llama"


def gguf_config_dict(metadata: dict[str, Any], tensor_names: tuple[str, ...]) -> dict[str, Any]:
    """The transformers config dict of a Llama GGUF file, as `load_gguf_checkpoint(path)["config"]` builds it.

    Only scalar metadata is read (a vocabulary array arrives as its length, `read_gguf_metadata`'s default)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    architecture = metadata["general.architecture"]
    if architecture != LLAMA or "mistral" in str(metadata.get("general.name", "")):
        raise ValueError(f"this converter reads Llama GGUF files; this one's architecture is {architecture!r}")
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = renames.get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            config[renamed] = value
    config.setdefault("vocab_size", metadata.get("tokenizer.ggml.tokens"))  # a count, as noted above
    return config


def _hf_to_gguf_names(model: torch.nn.Module, num_layers: int) -> dict[str, str]:
    """{gguf tensor name: HF parameter name} for the model's state dict, through gguf-py's name table."""
    from gguf import MODEL_ARCH, get_tensor_name_map

    table = get_tensor_name_map(MODEL_ARCH.LLAMA, num_layers)
    names = {}
    for hf_name in model.state_dict():
        stem, _, suffix = hf_name.rpartition(".")
        gguf_stem = table.get_name(stem)
        if gguf_stem is not None:
            names[f"{gguf_stem}.{suffix}"] = hf_name
    return names


def _raw_tensors(gguf_path: Path):
    """(gguf name, ggml type, the tensor's bytes or values as gguf-py's reader shapes them) for every tensor."""
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict

    header = GgufHeader.from_file(str(gguf_path))
    lazy = load_gguf_state_dict(header)
    for info in header.tensors:
        data = lazy[info.name].data
        if info.ggml_type in (0, 1):  # F32 / F16: values, not blocks
            data = data.view(np.float32 if info.ggml_type == 0 else np.float16)
        yield info.name, info.ggml_type, data.reshape(lazy[info.name].shape)


def llama_state_dict(gguf_path: Path, config, model_names: dict[str, str]) -> dict[str, torch.Tensor]:
    """Every tensor of the file dequantized to fp32 under its HF name; a tensor the model has no place for is an
    error (transformers would drop it silently)."""
    from gguf import GGMLQuantizationType, dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config=config.to_dict())
    state = {}
    for name, ggml_type, data in _raw_tensors(gguf_path):
        if name not in model_names:
            raise ValueError(f"{gguf_path}: tensor {name!r} has no place in {type(config).__name__}'s model")
        weights = processor.process(weights=dequantize(data, GGMLQuantizationType(ggml_type)), name=name).weights
        state[model_names[name]] = torch.from_numpy(np.copy(weights)).to(torch.float32)
    return state


def convert_llama_gguf(gguf_path: Path, dest: Path) -> Path:
    """Write `gguf_path` (a Llama GGUF) to `dest` as an fp32 HF directory with `architectures` set and no
    quantization config: config.json, generation_config.json, model.safetensors, the tokenizer files."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig, LlamaForCausalLM, TokenizersBackend
    from transformers.integrations.gguf.reader import read_gguf_metadata

    metadata, tensor_names = read_gguf_metadata(str(gguf_path))
    config = AutoConfig.for_model(**gguf_config_dict(metadata, tensor_names))
    config.architectures = [LlamaForCausalLM.__name__]
    config.dtype = "float32"
    with torch.device("meta"):  # only its parameter names are needed
        names = _hf_to_gguf_names(LlamaForCausalLM(config), config.num_hidden_layers)
    state = llama_state_dict(gguf_path, config, names)
    missing = set(names.values()) - set(state) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"{gguf_path} lacks the model's tensors {sorted(missing)}")
    if config.tie_word_embeddings:  # as save_pretrained does: the embedding is stored, the tied head is not
        state.pop("lm_head.weight", None)

    dest.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(dest)
    GenerationConfig.from_model_config(config).save_pretrained(dest)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    # The class AutoTokenizer resolves for a GGUF without a tokenizer class of its own; its constructor converts
    # the file's vocabulary, merges and special tokens (transformers' GGUF tokenizer conversion).
    TokenizersBackend.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(dest)
    return dest


def has_fast_gguf_reader() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers.integrations.gguf") is not None


def convert_with_transformers(gguf_path: Path, dest: Path) -> Path:
    """What `convert_llama_gguf` writes, through transformers' own GGUF loading (`from_pretrained(..., gguf_file=)`,
    about 3x slower): the oracle of its test, and the way for a transformers without the fast GGUF reader."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = model.config
    if hasattr(config, "quantization_config"):  # a GGUF-derived config carries its quantisation
        del config.quantization_config
    config.architectures = [type(model).__name__]  # and lacks `architectures`, which vLLM needs
    config.torch_dtype = "float32"
    dest.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    state = model.state_dict()
    if config.tie_word_embeddings:  # as save_pretrained does: the embedding is stored, the tied head is not
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(dest)
    return dest
