"""Hugging Face ↔ Megatron-Core for the dense decoders this engine trains (Llama, Qwen2, Qwen3), with no
Megatron-Bridge.

Three pieces, each working on megatron-core 0.16 (Python 3.11) and 0.19 (Python 3.12) alike:

* `HFArchitecture.from_pretrained(dir)`: the HF config read into the few numbers a GPT model needs; anything
  this mapping would silently get wrong (rope scaling, Llama's attention / MLP biases, sliding windows, another
  family) is refused with a message naming the config field.
* `transformer_config` / `layer_spec`: Megatron's TransformerConfig and GPT layer spec for it (Transformer
  Engine layers when TE is installed, Megatron's local layers otherwise).
* `load_hf_weights` (HF safetensors → this rank's parameter shards) and `export_hf_weights` (parameter shards
  → full HF-named tensors, gathered over tensor- and pipeline-parallel ranks; collective).

Layouts (per layer): Megatron fuses q/k/v into one `linear_qkv` whose rows are grouped by query group, each
group holding its query heads, then its key head, then its value head ([q…q k v] × groups); tensor parallelism
splits the groups. `linear_fc1` holds gate and up; each tensor-parallel rank holds its slice of gate followed by
its slice of up. The vocabulary is padded to a multiple of the tensor-parallel size (rows of zeros, cut off again
on export and from the logits). Tied embeddings have one matrix: exported as `model.embed_tokens.weight`, and
also as `lm_head.weight` when asked (vLLM needs it).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from vime_engine.train.megatron_layout import ParallelLayout

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# model_type → (q/k/v biases, per-head q/k RMSNorm). Llama's optional biases are refused in `from_hf_config`.
_FAMILIES = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True)}

# A converted checkpoint (vime_engine.convert): torch_dist weights in TORCH_DIST_ITERATION_DIR/, the source's
# config and tokenizer in HF_CONFIG_DIR/.
TORCH_DIST_ITERATION_DIR = "iter_0000000"
HF_CONFIG_DIR = "hf_config"
MARKER = "conversion.json"  # written last by a conversion that verified its round trip
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def is_converted_checkpoint(path: str | Path) -> bool:
    return (Path(path) / TORCH_DIST_ITERATION_DIR).is_dir() and (Path(path) / HF_CONFIG_DIR / "config.json").is_file()


def copy_non_weight_files(source: Path, dest: Path) -> None:
    """Config, generation config, tokenizer and chat template: everything but the weight files."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and path.name != MARKER:
            if "index.json" not in path.name:
                shutil.copy2(path, dest / path.name)


def architecture_of(path: str | Path) -> HFArchitecture:
    """The architecture of an HF directory or of a converted checkpoint (from the config kept beside it)."""
    path = Path(path)
    return HFArchitecture.from_pretrained(path / HF_CONFIG_DIR if is_converted_checkpoint(path) else path)


class UnsupportedHFModel(ValueError):
    """An HF model this mapping cannot represent exactly; the message names the config field."""


@dataclass(frozen=True)
class HFArchitecture:
    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_positions: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> HFArchitecture:
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(str(directory)), source=str(directory))

    @classmethod
    def from_hf_config(cls, config, source: str = "the model") -> HFArchitecture:
        model_type = getattr(config, "model_type", None)
        if model_type not in _FAMILIES:
            raise UnsupportedHFModel(
                f"{source}: model_type {model_type!r} has no Megatron mapping here; supported: "
                f"{', '.join(_FAMILIES)} (or train with --train-backend torch)"
            )
        qkv_bias, qk_norm = _FAMILIES[model_type]
        for field in ("attention_bias", "mlp_bias"):
            if model_type == "llama" and getattr(config, field, False):
                raise UnsupportedHFModel(f"{source}: config.{field}=true is not supported by the Megatron mapping")
        if model_type == "qwen3" and getattr(config, "attention_bias", False):
            raise UnsupportedHFModel(f"{source}: config.attention_bias=true is not supported by the Megatron mapping")
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedHFModel(f"{source}: config.use_sliding_window=true is not supported by Megatron")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedHFModel(f"{source}: config.hidden_act={config.hidden_act!r}: only silu is mapped")
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise UnsupportedHFModel(f"{source}: rope scaling {rope!r} is not supported by the Megatron mapping")
        heads = config.num_attention_heads
        return cls(
            model_type=model_type, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size, num_layers=config.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            norm_eps=config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            max_positions=config.max_position_embeddings,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)), qkv_bias=qkv_bias, qk_norm=qk_norm,
        )

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        return -(-self.vocab_size // tensor_parallel) * tensor_parallel


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_config(arch: HFArchitecture, layout: ParallelLayout, dtype: torch.dtype, use_cpu_initialization: bool):
    """Megatron's TransformerConfig for `arch` under `layout` (fused kernels only where TE provides them).

    Megatron's random init stays on even when HF weights are loaded next: it is what marks the parameters'
    tensor-parallel attributes, which the mapping, the gradient norm and the optimizer read.
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    fused = transformer_engine_available()
    extra = {}
    if layout.attention_softmax_in_fp32 is not None:
        extra["attention_softmax_in_fp32"] = layout.attention_softmax_in_fp32
    if layout.attention_backend is not None:
        from megatron.core.transformer.enums import AttnBackend

        extra["attention_backend"] = AttnBackend[layout.attention_backend]
    if layout.recompute_granularity is not None:
        extra.update(recompute_granularity=layout.recompute_granularity, recompute_method=layout.recompute_method,
                     recompute_num_layers=layout.recompute_num_layers)
    if layout.expert_tensor is not None:
        extra["expert_tensor_parallel_size"] = layout.expert_tensor
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
        hidden_dropout=layout.hidden_dropout, attention_dropout=layout.attention_dropout,
        tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
        context_parallel_size=layout.context, expert_model_parallel_size=layout.expert,
        sequence_parallel=layout.sequence_parallel,
        # Micro-batches are padded to their own longest sample, so pipeline stages exchange varying shapes; Megatron
        # checks the MoE dispatcher allows that even for dense models (none dispatches here).
        variable_seq_lengths=layout.pipeline > 1, moe_token_dispatcher_type="alltoall",
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        masked_softmax_fusion=fused, bias_activation_fusion=fused, bias_dropout_fusion=fused,
        apply_rope_fusion=fused, persist_layer_norm=fused,
        gradient_accumulation_fusion=fused and layout.gradient_accumulation_fusion,
        **extra,
    )


def layer_spec(arch: HFArchitecture):
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_engine_available():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")


# -- names and layouts -----------------------------------------------------------------------------------------
# Megatron name (inside a decoder layer) → (how the HF tensors combine, the HF names inside `model.layers.{i}.`).
# TE layer specs fuse each RMSNorm into the linear after it (`layer_norm_weight`); local specs keep separate norms.
_LAYER = {
    "input_layernorm.weight": ("copy", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("copy", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": ("qkv", tuple(f"self_attn.{p}_proj.weight" for p in "qkv")),
    "self_attention.linear_qkv.bias": ("qkv", tuple(f"self_attn.{p}_proj.bias" for p in "qkv")),
    "self_attention.q_layernorm.weight": ("copy", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("copy", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("copy", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("copy", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("copy", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("copy", ("mlp.down_proj.weight",)),
}
_OUTSIDE_LAYERS = {
    "embedding.word_embeddings.weight": ("vocab", (EMBED,)),
    "decoder.final_layernorm.weight": ("copy", ("model.norm.weight",)),
    "output_layer.weight": ("vocab", (LM_HEAD,)),
}


def _hf_source(name: str, module: torch.nn.Module, arch: HFArchitecture) -> tuple[str, tuple[str, ...]]:
    """(combination, HF names) for Megatron parameter `name` of GPTModel `module` (layer numbers made global)."""
    if name.startswith("decoder.layers."):
        local, rest = name[len("decoder.layers."):].split(".", 1)
        if rest not in _LAYER:
            raise UnsupportedHFModel(f"Megatron parameter {name} has no HF counterpart in the mapping")
        layer = module.decoder.layers[int(local)].layer_number - 1  # 1-based and global across pipeline stages
        kind, names = _LAYER[rest]
        return kind, tuple(f"model.layers.{layer}.{n}" for n in names)
    if name not in _OUTSIDE_LAYERS:
        raise UnsupportedHFModel(f"Megatron parameter {name} has no HF counterpart in the mapping")
    kind, names = _OUTSIDE_LAYERS[name]
    if name == "output_layer.weight" and arch.tied_embeddings:
        names = (EMBED,)  # the last pipeline stage's copy of the shared matrix
    return kind, names


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, arch: HFArchitecture) -> Tensor:
    groups, per_group = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads
    rest = q.shape[1:]
    fused = torch.cat([
        q.reshape(groups, per_group * arch.head_dim, *rest),
        k.reshape(groups, arch.head_dim, *rest),
        v.reshape(groups, arch.head_dim, *rest),
    ], dim=1)
    return fused.reshape(-1, *rest)


def _split_qkv(fused: Tensor, arch: HFArchitecture) -> tuple[Tensor, Tensor, Tensor]:
    groups, per_group = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads
    rest = fused.shape[1:]
    q, k, v = fused.reshape(groups, -1, *rest).split(
        [per_group * arch.head_dim, arch.head_dim, arch.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _tp_split(param: Tensor) -> int | None:
    """The dimension tensor parallelism splits `param` along, or None when every rank holds all of it."""
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def megatron_shard(kind: str, hf: list[Tensor], arch: HFArchitecture, split_dim: int | None, rank: int,
                   size: int) -> Tensor:
    """This tensor-parallel rank's piece of one Megatron parameter, from its HF tensors."""
    if kind == "gate_up":  # each rank: its slice of gate, then its slice of up
        gate, up = (t.chunk(size, dim=0)[rank] for t in hf)
        return torch.cat([gate, up])
    if kind == "qkv":
        full = _fuse_qkv(*hf, arch)
    elif kind == "vocab":
        full = torch.zeros(arch.padded_vocab_size(size), *hf[0].shape[1:], dtype=hf[0].dtype)
        full[: arch.vocab_size] = hf[0]
    else:
        full = hf[0]
    return full if split_dim is None else full.chunk(size, dim=split_dim)[rank]


def hf_tensors(kind: str, shards: list[Tensor], arch: HFArchitecture, split_dim: int | None) -> list[Tensor]:
    """The HF tensors of one Megatron parameter from its shards on every tensor-parallel rank (in rank order)."""
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    full = shards[0] if split_dim is None else torch.cat(shards, dim=split_dim)
    if kind == "qkv":
        return list(_split_qkv(full, arch))
    if kind == "vocab":
        return [full[: arch.vocab_size]]
    return [full]


# -- HF → Megatron ---------------------------------------------------------------------------------------------
def _open_safetensors(hf_dir: Path) -> dict[str, Path]:
    """HF tensor name → the safetensors file holding it."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return {name: hf_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = hf_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def load_hf_weights(modules: list[torch.nn.Module], arch: HFArchitecture, hf_dir: str | Path) -> None:
    """Copy the HF checkpoint's tensors into this rank's parameter shards of the (unwrapped) GPT modules.

    Every parameter must be filled; with the whole model on this rank (no pipeline split) every HF tensor must
    also be used, so a weight the mapping does not know (a bias, an extra norm) fails here instead of vanishing.
    """
    from megatron.core import parallel_state
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    files = _open_safetensors(hf_dir)
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    handles: dict[Path, object] = {}
    used: set[str] = set()

    def read(name: str) -> Tensor:
        if name not in files:
            raise UnsupportedHFModel(f"{hf_dir}: tensor {name} missing from the checkpoint")
        if files[name] not in handles:
            handles[files[name]] = safe_open(str(files[name]), framework="pt")
        used.add(name)
        return handles[files[name]].get_tensor(name)

    with torch.no_grad():
        for module in modules:
            for name, param in module.named_parameters():
                kind, names = _hf_source(name, module, arch)
                shard = megatron_shard(kind, [read(n) for n in names], arch, _tp_split(param), rank, size)
                if shard.shape != param.shape:
                    raise UnsupportedHFModel(
                        f"{hf_dir}: {', '.join(names)} give {name} the shape {tuple(shard.shape)}, Megatron expects "
                        f"{tuple(param.shape)}"
                    )
                param.copy_(shard)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        unused = set(files) - used - ({LM_HEAD} if arch.tied_embeddings else set())
        if unused:
            raise UnsupportedHFModel(f"{hf_dir}: tensors the Megatron mapping does not use: {sorted(unused)[:5]}")


# -- Megatron → HF ---------------------------------------------------------------------------------------------
def _stage_hf_tensors(modules: list[torch.nn.Module], arch: HFArchitecture,
                      with_lm_head: bool) -> Iterator[tuple[str, Tensor]]:
    """This pipeline stage's HF tensors, gathered over tensor-parallel ranks (collective within the TP group)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    size = parallel_state.get_tensor_model_parallel_world_size()
    for module in modules:
        for name, param in module.named_parameters():
            if name == "output_layer.weight" and arch.tied_embeddings:
                continue  # the first stage exports the shared matrix
            kind, names = _hf_source(name, module, arch)
            split_dim = _tp_split(param)
            shards = [param.detach()]
            if size > 1 and split_dim is not None:
                shards = [torch.empty_like(param) for _ in range(size)]
                torch.distributed.all_gather(shards, param.detach().contiguous(), group=group)
            for hf_name, tensor in zip(names, hf_tensors(kind, shards, arch, split_dim)):
                yield hf_name, tensor
                if hf_name == EMBED and arch.tied_embeddings and with_lm_head:
                    yield LM_HEAD, tensor


def export_hf_weights(modules: list[torch.nn.Module], arch: HFArchitecture,
                      with_lm_head: bool) -> Iterator[tuple[str, Tensor]]:
    """Every HF tensor of the model, on every rank (collective over TP and PP: every rank must iterate to the end).

    With pipeline parallelism each stage in turn broadcasts its tensors to the other stages.
    """
    from megatron.core import parallel_state

    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if stages == 1:
        yield from _stage_hf_tensors(modules, arch, with_lm_head)
        return
    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = torch.distributed.get_process_group_ranks(group)
    mine = parallel_state.get_pipeline_model_parallel_rank()
    device = next(modules[0].parameters()).device
    for stage in range(stages):
        local = list(_stage_hf_tensors(modules, arch, with_lm_head)) if stage == mine else []
        header = [[(name, tuple(t.shape), t.dtype) for name, t in local]]
        torch.distributed.broadcast_object_list(header, src=ranks[stage], group=group)
        for i, (name, shape, dtype) in enumerate(header[0]):
            tensor = local[i][1].contiguous() if local else torch.empty(shape, dtype=dtype, device=device)
            torch.distributed.broadcast(tensor, src=ranks[stage], group=group)
            yield name, tensor
