"""Megatron's model-architecture flags, as vime's `scripts/models/*.sh` set them, checked against config.json.

The engine builds every model from its HF config (vime_engine/train/megatron_hf.py maps it to Megatron's
TransformerConfig), so these flags describe the model; they never change it. A flag that agrees with
config.json passes; one that disagrees is refused, naming the flag, the HF field and both values; one that asks
for an architecture the engine does not build (learned absolute positions, LayerNorm) is refused with the reason.

What each flag means is Megatron's: without --group-query-attention Megatron builds one key/value head per
attention head, so --num-query-groups counts only with it; --disable-bias-linear drops the bias of every
linear layer except the q/k/v projections' where --add-qkv-bias keeps them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

class ModelFlagMismatch(ValueError):
    """A model-architecture flag that does not describe the model in --hf-checkpoint."""


@dataclass(frozen=True)
class HFView:
    """The config.json fields the flags are compared with, defaulted as transformers defaults them."""

    config: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)

    @property
    def heads(self) -> int:
        return self.config["num_attention_heads"]

    @property
    def kv_heads(self) -> int:
        return self.get("num_key_value_heads") or self.heads

    @property
    def head_dim(self) -> int:
        return self.get("head_dim") or self.config["hidden_size"] // self.heads

    @property
    def num_experts(self) -> int | None:
        """Routed experts of each MoE layer (config.json's num_experts; transformers 5 writes num_local_experts);
        None for a dense model."""
        return self.get("num_experts") or self.get("num_local_experts")

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.get("rope_parameters") or self.get("rope_scaling") or {})

    @property
    def rope_theta(self) -> float | None:
        theta = self.rope.get("rope_theta", self.get("rope_theta"))
        return None if theta is None else float(theta)

    @property
    def rope_type(self) -> str:
        return self.rope.get("rope_type", self.rope.get("type", "default"))

    @property
    def qkv_bias(self) -> bool:
        return self.get("model_type") == "qwen2" or bool(self.get("attention_bias", False))

    @property
    def other_linear_bias(self) -> bool:
        """Biases on the attention output and MLP projections (Qwen2's attention_bias covers q/k/v only)."""
        o_proj = self.get("model_type") != "qwen2" and bool(self.get("attention_bias", False))
        return o_proj or bool(self.get("mlp_bias", False))


@dataclass(frozen=True)
class Rule:
    """One flag: the config.json field it describes and the value the model has there."""

    hf_field: str
    model_value: Callable[[HFView], Any]


def _same(flag_value: Any, model_value: Any) -> bool:
    if isinstance(flag_value, float) or isinstance(model_value, float):
        return model_value is not None and math.isclose(float(flag_value), float(model_value), rel_tol=1e-9)
    return flag_value == model_value


RULES: dict[str, Rule] = {
    "num-layers": Rule("num_hidden_layers", lambda m: m.get("num_hidden_layers")),
    "hidden-size": Rule("hidden_size", lambda m: m.get("hidden_size")),
    "ffn-hidden-size": Rule("intermediate_size", lambda m: m.get("intermediate_size")),
    "num-attention-heads": Rule("num_attention_heads", lambda m: m.heads),
    "kv-channels": Rule("head_dim", lambda m: m.head_dim),
    "vocab-size": Rule("vocab_size", lambda m: m.get("vocab_size")),
    "max-position-embeddings": Rule("max_position_embeddings", lambda m: m.get("max_position_embeddings")),
    "norm-epsilon": Rule("rms_norm_eps", lambda m: m.get("rms_norm_eps")),
    "rotary-base": Rule("rope_theta", lambda m: m.rope_theta),
    "rotary-scaling-factor": Rule("rope_scaling.factor", lambda m: m.rope.get("factor")),
    "swiglu": Rule("hidden_act (silu: a gated SiLU MLP)", lambda m: m.get("hidden_act", "silu") in ("silu", "swish")),
    "qk-layernorm": Rule("model_type (Qwen3's and Qwen3-MoE's per-head q/k RMSNorm)",
                         lambda m: m.get("model_type") in ("qwen3", "qwen3_moe")),
    "add-qkv-bias": Rule("q/k/v projection biases (Qwen2, attention_bias)", lambda m: m.qkv_bias),
    "disable-bias-linear": Rule("attention_bias / mlp_bias", lambda m: not m.other_linear_bias),
    "untie-embeddings-and-output-weights": Rule("tie_word_embeddings", lambda m: not m.get("tie_word_embeddings", False)),
    "use-rope-scaling": Rule("rope_scaling", lambda m: m.rope_type != "default"),
    "use-rotary-position-embeddings": Rule("rotary position embeddings (every mapped family)", lambda m: True),
    # Mixture of experts (vime's scripts/models/qwen3-30B-A3B.sh); a dense model has none of these fields.
    "num-experts": Rule("num_experts", lambda m: m.num_experts),
    "moe-router-topk": Rule("num_experts_per_tok", lambda m: m.get("num_experts_per_tok")),
    "moe-ffn-hidden-size": Rule("moe_intermediate_size", lambda m: m.get("moe_intermediate_size")),
}
# Flags that choose among architectures: the value the engine builds, and why another is refused.
CHOICES: dict[str, tuple[str, str]] = {
    "normalization": ("RMSNorm", "the engine builds RMSNorm models only (Llama, Qwen2, Qwen3)"),
    "position-embedding-type": ("rope", "the engine builds rotary position embeddings only (learned absolute "
                                        "positions are not built)"),
    "moe-router-score-function": ("softmax", "the engine's mixture-of-experts models (Qwen3-MoE) score experts by "
                                             "a softmax over the router's logits"),
    "moe-router-load-balancing-type": ("aux_loss", "the torch backends add the Switch Transformer loss (aux_loss) "
                                                   "of each micro-batch; --moe-aux-loss-coeff 0 turns it off"),
}
MODEL_FLAGS = (*RULES, *CHOICES, "group-query-attention", "num-query-groups")


def check_model_flags(flags: dict[str, Any], config: dict[str, Any], where: str) -> None:
    """Raise ModelFlagMismatch for the first flag in `flags` (Megatron flags by name) that does not describe the
    model whose config.json is `config` (read from `where`). Flags not given are not checked."""
    model = HFView(config)
    for flag, (built, why) in CHOICES.items():
        if flag in flags and str(flags[flag]).lower() != built.lower():
            raise ModelFlagMismatch(f"--{flag} {flags[flag]}: {why}; give --{flag} {built} or drop it")
    use_rope = flags.get("use-rotary-position-embeddings")
    if use_rope is False:
        raise ModelFlagMismatch(f"--use-rotary-position-embeddings false: {CHOICES['position-embedding-type'][1]}")
    for flag, rule in RULES.items():
        if flag in flags and not _same(flags[flag], rule.model_value(model)):
            _refuse(flag, flags[flag], rule.hf_field, rule.model_value(model), where)
    if "group-query-attention" in flags or "num-query-groups" in flags:
        groups = flags.get("num-query-groups", 1) if flags.get("group-query-attention") else model.heads
        if groups != model.kv_heads:
            shown = (f"--group-query-attention --num-query-groups {flags.get('num-query-groups', 1)}"
                     if flags.get("group-query-attention") else "no --group-query-attention (one group per head)")
            raise ModelFlagMismatch(
                f"{shown} gives {groups} key/value head(s); config.json num_key_value_heads = {model.kv_heads} "
                f"({where}); the model flags describe the model and never change it: fix them or drop them")


def _refuse(flag: str, given: Any, field: str, found: Any, where: str) -> None:
    if isinstance(given, bool):
        state = "has" if found else "does not have"
        raise ModelFlagMismatch(
            f"--{flag} {'true' if given else 'false'}: the model {state} it (config.json {field}, {where}); the "
            f"model flags describe the model and never change it: drop the flag")
    raise ModelFlagMismatch(
        f"--{flag} {given} disagrees with config.json {field} = {found} ({where}); the model flags describe the "
        f"model and never change it: give --{flag} {found} or drop the flag")
