"""Hugging Face ↔ Megatron-Core for the decoders this engine trains (Llama, Qwen2, Qwen3 dense, Qwen3-MoE), with no
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

Mixture of experts (Qwen3-MoE): each MoE layer's router (`mlp.router.weight` ← `mlp.gate.weight`, on every rank) and
its routed experts, each a gated MLP laid out like the dense one (`linear_fc1` = gate then up, `linear_fc2` = down;
split by expert tensor parallelism). Expert parallelism deals the experts out in blocks: rank r of the
expert-parallel group holds experts r·L … r·L+L−1 (L = experts / EP size) as its local experts 0 … L−1, in
Megatron's SequentialMLP (`local_experts.{j}.linear_fc1.weight`) or, with Transformer Engine's grouped GEMM,
TEGroupedMLP (`linear_fc1.weight{j}`). Qwen3-MoE has no shared expert; a config that declares one is refused.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from vime_engine.train.megatron_layout import BRIDGE_FAMILIES, MoESettings, ParallelLayout
from vime_engine.train.megatron_model_flags import moe_layer_pattern

log = logging.getLogger(__name__)
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# model_type → (q/k/v biases, per-head q/k RMSNorm). Llama's optional biases are refused in `from_hf_config`.
_FAMILIES = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True), "qwen3_moe": (False, True)}
_MOE_FAMILIES = ("qwen3_moe",)

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


def hf_config_dir(path: str | Path) -> Path:
    """Where the HF config of an HF directory or of a converted checkpoint (kept beside its weights) lies."""
    path = Path(path)
    return path / HF_CONFIG_DIR if is_converted_checkpoint(path) else path


def architecture_of(path: str | Path, bridge: bool = False) -> HFArchitecture:
    """The architecture of an HF directory or of a converted checkpoint (from the config kept beside it)."""
    return HFArchitecture.from_pretrained(hf_config_dir(path), bridge=bridge)


class UnsupportedHFModel(ValueError):
    """An HF model this mapping cannot represent exactly; the message names the config field."""


@dataclass(frozen=True)
class MoEArchitecture:
    """The routed experts of a mixture-of-experts model (Qwen3-MoE: no shared expert).

    Routing (HF's and vLLM's): softmax over the router's logits, the top-k experts, their probabilities
    renormalised to sum to 1 when `renormalize` (config.norm_topk_prob). Megatron's softmax router gives the same
    weights as a softmax over the top-k logits (renormalised) or, with pre-softmax, the top-k of the full softmax.
    """

    num_experts: int
    ffn_hidden_size: int  # each expert's intermediate size (moe_intermediate_size)
    topk: int
    renormalize: bool
    layer_pattern: tuple[int, ...]  # per layer: 1 a MoE layer, 0 a dense MLP of the model's intermediate_size

    @classmethod
    def from_hf_config(cls, config, num_layers: int, source: str) -> MoEArchitecture:
        num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        if not num_experts:
            raise UnsupportedHFModel(f"{source}: config.num_experts is missing for model_type {config.model_type}")
        if getattr(config, "shared_expert_intermediate_size", 0):
            raise UnsupportedHFModel(f"{source}: config.shared_expert_intermediate_size: shared experts are not "
                                     "mapped for this family")
        pattern = moe_layer_pattern(num_layers, getattr(config, "decoder_sparse_step", 1) or 1,
                                    list(getattr(config, "mlp_only_layers", None) or []))
        return cls(num_experts=num_experts, ffn_hidden_size=config.moe_intermediate_size,
                   topk=config.num_experts_per_tok, renormalize=bool(getattr(config, "norm_topk_prob", False)),
                   layer_pattern=pattern)


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
    moe: MoEArchitecture | None = None  # None: a dense model
    # True for BRIDGE_FAMILIES: Megatron-Bridge's provider builds the model and moves its weights (megatron_bridge);
    # the fields above are then only what the backend reads (vocabulary, layers, experts), not a model to build.
    built_by_bridge: bool = False
    # The checkpoint's multi-token-prediction layers (num_nextn_predict_layers), stored after the decoder's: not built
    # into the model, their tensors carried unchanged into exports (megatron_mtp).
    mtp_layers: int = 0

    @classmethod
    def from_pretrained(cls, directory: str | Path, bridge: bool = False) -> HFArchitecture:
        """The architecture of an HF directory; `bridge` (`--megatron-to-hf-mode bridge`) admits BRIDGE_FAMILIES."""
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(str(directory)), source=str(directory), bridge=bridge)

    @classmethod
    def from_hf_config(cls, config, source: str = "the model", bridge: bool = False) -> HFArchitecture:
        model_type = getattr(config, "model_type", None)
        if model_type in BRIDGE_FAMILIES:
            if not bridge:
                raise UnsupportedHFModel(
                    f"{source}: model_type {model_type!r} ({BRIDGE_FAMILIES[model_type]}) has no Megatron mapping of "
                    "the engine's own; Megatron-Bridge builds it: use --megatron-to-hf-mode bridge")
            return cls._built_by_bridge(config, source)
        if model_type not in _FAMILIES:
            bridged = ", ".join(f"{t} with --megatron-to-hf-mode bridge" for t in BRIDGE_FAMILIES)
            raise UnsupportedHFModel(
                f"{source}: model_type {model_type!r} has no Megatron mapping here; supported: "
                f"{', '.join(_FAMILIES)}, {bridged} (or train with --train-backend torch)"
            )
        qkv_bias, qk_norm = _FAMILIES[model_type]
        for field in ("attention_bias", "mlp_bias"):
            if model_type == "llama" and getattr(config, field, False):
                raise UnsupportedHFModel(f"{source}: config.{field}=true is not supported by the Megatron mapping")
        if model_type in ("qwen3", "qwen3_moe") and getattr(config, "attention_bias", False):
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
            moe=MoEArchitecture.from_hf_config(config, config.num_hidden_layers, source)
            if model_type in _MOE_FAMILIES else None,
        )

    @classmethod
    def _built_by_bridge(cls, config, source: str) -> HFArchitecture:
        """What the backend reads of a BRIDGE_FAMILIES model: its first `first_k_dense_replace` layers are dense, the
        rest MoE layers of `n_routed_experts` (their shared experts and routing are the provider's business); its
        multi-token-prediction layers are counted, not built (megatron_mtp)."""
        layers, dense = config.num_hidden_layers, config.first_k_dense_replace
        heads = config.num_attention_heads
        if not config.norm_topk_prob and config.num_experts_per_tok > 1:
            raise UnsupportedHFModel(f"{source}: config.norm_topk_prob = false: Megatron's sigmoid router always "
                                     "renormalises the top-k scores")
        return cls(
            model_type=config.model_type, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size, num_layers=layers, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "qk_head_dim", None) or getattr(config, "head_dim", None)
            or config.hidden_size // heads,
            norm_eps=config.rms_norm_eps, rope_theta=float(config.rope_parameters.get("rope_theta", 10000.0)),
            max_positions=config.max_position_embeddings,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)), qkv_bias=False, qk_norm=False,
            moe=MoEArchitecture(num_experts=config.n_routed_experts, ffn_hidden_size=config.moe_intermediate_size,
                                topk=config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob),
                                layer_pattern=(0,) * dense + (1,) * (layers - dense)),
            built_by_bridge=True, mtp_layers=getattr(config, "num_nextn_predict_layers", 0) or 0,
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

    fields = layout_fields(layout, dtype, use_cpu_initialization)
    if arch.moe is not None:
        fields.update(moe_config(arch.moe, layout.moe, transformer_engine_available()))
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm, **fields,
    )


def layout_fields(layout: ParallelLayout, dtype: torch.dtype, use_cpu_initialization: bool) -> dict:
    """TransformerConfig's fields that the parallel layout, the dtype and the machine decide, not the model: set on
    `transformer_config`'s config, and on Megatron-Bridge's provider for BRIDGE_FAMILIES (megatron_bridge)."""
    fused = transformer_engine_available()
    # Micro-batches are padded to their own longest sample, so pipeline stages exchange varying shapes; Megatron
    # checks the MoE dispatcher allows that even for dense models (none dispatches there).
    extra = {"moe_token_dispatcher_type": "alltoall"}
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
    return dict(
        hidden_dropout=layout.hidden_dropout, attention_dropout=layout.attention_dropout,
        tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline,
        context_parallel_size=layout.context, expert_model_parallel_size=layout.expert,
        sequence_parallel=layout.sequence_parallel,
        variable_seq_lengths=layout.pipeline > 1,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        masked_softmax_fusion=fused, bias_activation_fusion=fused, bias_dropout_fusion=fused,
        apply_rope_fusion=fused and layout.rope_fusion, persist_layer_norm=fused,
        gradient_accumulation_fusion=fused and layout.gradient_accumulation_fusion,
        **extra,
    )


@functools.cache
def _say_unfused(flag: str) -> None:
    """Once a process: a Transformer Engine kernel asked for that this machine does not have."""
    log.warning("%s: Transformer Engine is not installed here, so the experts run without that kernel (the same "
                "function and checkpoint layout, only slower)", flag)


def moe_config(moe: MoEArchitecture, settings: MoESettings, transformer_engine: bool) -> dict:
    """TransformerConfig's mixture-of-experts fields: the experts and routing of config.json, run as `settings`
    (megatron_layout.MoESettings) say."""
    return dict(
        num_moe_experts=moe.num_experts, moe_ffn_hidden_size=moe.ffn_hidden_size, moe_router_topk=moe.topk,
        moe_router_score_function="softmax", moe_router_pre_softmax=not moe.renormalize,
        moe_layer_freq=1 if all(moe.layer_pattern) else list(moe.layer_pattern),
        **moe_run_fields(settings, transformer_engine),
    )


def moe_run_fields(settings: MoESettings, transformer_engine: bool) -> dict:
    """How the MoE layers run, whoever builds them (`moe_config`, or Megatron-Bridge's provider): no token is ever
    dropped (no capacity factor), as vLLM drops none; TE's kernels only where TE is installed."""
    for flag, wanted in (("--moe-grouped-gemm", settings.grouped_gemm), ("--moe-permute-fusion", settings.permute_fusion)):
        if wanted and not transformer_engine:
            _say_unfused(flag)
    return dict(
        moe_token_dispatcher_type=settings.token_dispatcher, moe_router_dtype=settings.router_dtype,
        moe_router_load_balancing_type="aux_loss" if settings.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=settings.aux_loss_coeff, moe_token_drop_policy=settings.token_drop_policy,
        moe_grouped_gemm=settings.grouped_gemm and transformer_engine,
        moe_permute_fusion=settings.permute_fusion and transformer_engine,
    )


def layer_spec(arch: HFArchitecture, config):
    """The decoder's layer spec: Transformer Engine layers when TE is installed, Megatron's local layers otherwise;
    for a mixture-of-experts model one spec per layer (MoE or dense MLP, config.moe_layer_freq)."""
    from megatron.core.models.gpt import gpt_layer_specs

    te = transformer_engine_available()
    if arch.moe is not None:
        return gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    if te:
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
    "mlp.router.weight": ("copy", ("mlp.gate.weight",)),
}
# A routed expert's MLP inside a MoE layer: SequentialMLP's `local_experts.{j}.linear_fc1.weight`, or TEGroupedMLP's
# `linear_fc1.weight{j}`; j is the expert's index on this expert-parallel rank.
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(?P<j>\d+)\.(?P<fc>linear_fc[12])\.weight"
                     r"|(?P<grouped_fc>linear_fc[12])\.weight(?P<grouped_j>\d+))")
_EXPERT_MLP = {"linear_fc1": ("gate_up", ("gate_proj.weight", "up_proj.weight")),
               "linear_fc2": ("copy", ("down_proj.weight",))}
_HF_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
_OUTSIDE_LAYERS = {
    "embedding.word_embeddings.weight": ("vocab", (EMBED,)),
    "decoder.final_layernorm.weight": ("copy", ("model.norm.weight",)),
    "output_layer.weight": ("vocab", (LM_HEAD,)),
}


def is_expert(name: str) -> bool:
    """Whether Megatron parameter `name` belongs to a routed expert (split by expert, not tensor, parallelism)."""
    return _EXPERT.search(name) is not None


def _hf_source(name: str, module: torch.nn.Module, arch: HFArchitecture,
               first_expert: int = 0) -> tuple[str, tuple[str, ...]]:
    """(combination, HF names) for Megatron parameter `name` of GPTModel `module` (layer numbers made global; a
    routed expert's local index counted from `first_expert`, the first expert its expert-parallel rank holds)."""
    if name.startswith("decoder.layers."):
        local, rest = name[len("decoder.layers."):].split(".", 1)
        layer = module.decoder.layers[int(local)].layer_number - 1  # 1-based and global across pipeline stages
        expert = _EXPERT.fullmatch(rest)
        if expert is not None:
            index = first_expert + int(expert["j"] or expert["grouped_j"])
            kind, names = _EXPERT_MLP[expert["fc"] or expert["grouped_fc"]]
            return kind, tuple(f"model.layers.{layer}.mlp.experts.{index}.{n}" for n in names)
        if rest not in _LAYER:
            raise UnsupportedHFModel(f"Megatron parameter {name} has no HF counterpart in the mapping")
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
def safetensors_files(hf_dir: Path) -> dict[str, Path]:
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
    also be used, the experts of the other expert-parallel ranks aside, so a weight the mapping does not know (a
    bias, an extra norm) fails here instead of vanishing.
    """
    from megatron.core import parallel_state as ps
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    files = safetensors_files(hf_dir)
    dense = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    experts = _ExpertRanks.current(arch)
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
                expert = is_expert(name)
                kind, names = _hf_source(name, module, arch, experts.first if expert else 0)
                rank, size = experts.tensor if expert else dense
                shard = megatron_shard(kind, [read(n) for n in names], arch, _tp_split(param), rank, size)
                if shard.shape != param.shape:
                    raise UnsupportedHFModel(
                        f"{hf_dir}: {', '.join(names)} give {name} the shape {tuple(shard.shape)}, Megatron expects "
                        f"{tuple(param.shape)}"
                    )
                param.copy_(shard)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        others = {n for n in files if (m := _HF_EXPERT.match(n)) and not experts.holds(int(m[1]))}
        unused = set(files) - used - others - ({LM_HEAD} if arch.tied_embeddings else set())
        if unused:
            raise UnsupportedHFModel(f"{hf_dir}: tensors the Megatron mapping does not use: {sorted(unused)[:5]}")


@dataclass(frozen=True)
class _ExpertRanks:
    """This rank's place among the experts: the block of experts its expert-parallel rank holds, and its
    (rank, size) in the expert tensor-parallel group that splits each expert's matrices."""

    first: int
    count: int
    tensor: tuple[int, int]

    @classmethod
    def current(cls, arch: HFArchitecture) -> _ExpertRanks:
        from megatron.core import parallel_state as ps

        if arch.moe is None:
            return cls(0, 0, (0, 1))
        size = ps.get_expert_model_parallel_world_size()
        count = arch.moe.num_experts // size
        return cls(ps.get_expert_model_parallel_rank() * count, count,
                   (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()))

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count


# -- Megatron → HF ---------------------------------------------------------------------------------------------
def _gather(tensor: Tensor, group, size: int) -> list[Tensor]:
    """`tensor` of every rank of `group`, in rank order (collective)."""
    gathered = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(gathered, tensor.contiguous(), group=group)
    return gathered


def _stage_hf_tensors(modules: list[torch.nn.Module], arch: HFArchitecture,
                      with_lm_head: bool) -> Iterator[tuple[str, Tensor]]:
    """This pipeline stage's HF tensors, gathered over tensor-parallel ranks and, for the routed experts, over
    expert tensor- and expert-parallel ranks (collective within those groups)."""
    from megatron.core import parallel_state as ps

    dense = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    experts = _ExpertRanks.current(arch)
    expert_tensor = expert_parallel = (None, 1)
    if arch.moe is not None:
        expert_tensor = ps.get_expert_tensor_parallel_group(), experts.tensor[1]
        expert_parallel = ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size()
    for module in modules:
        for name, param in module.named_parameters():
            if name == "output_layer.weight" and arch.tied_embeddings:
                continue  # the first stage exports the shared matrix
            expert = is_expert(name)
            kind, names = _hf_source(name, module, arch)
            split_dim = _tp_split(param)
            group, size = expert_tensor if expert else dense
            shards = [param.detach()]
            if size > 1 and split_dim is not None:
                shards = _gather(param.detach(), group, size)
            tensors = hf_tensors(kind, shards, arch, split_dim)
            if not expert:
                for hf_name, tensor in zip(names, tensors):
                    yield hf_name, tensor
                    if hf_name == EMBED and arch.tied_embeddings and with_lm_head:
                        yield LM_HEAD, tensor
                continue
            # Expert-parallel rank r holds experts r·count …: its local expert j is expert r·count + j.
            by_rank = [_gather(t, *expert_parallel) if expert_parallel[1] > 1 else [t] for t in tensors]
            for r in range(expert_parallel[1]):
                names = _hf_source(name, module, arch, first_expert=r * experts.count)[1]
                for hf_name, gathered in zip(names, by_rank):
                    yield hf_name, gathered[r]


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
