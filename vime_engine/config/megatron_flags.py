"""Megatron-Core's flags: accepted so vime scripts carry over, handed to the Megatron backend untouched (in
EngineConfig.megatron), each value as the type Megatron declares for it."""

from __future__ import annotations

from typing import Any

from vime_engine.config.errors import ConfigError
from vime_engine.config.switches import switch_value

MEGATRON_FLAGS: dict[str, type] = {
    "tensor-model-parallel-size": int,
    "pipeline-model-parallel-size": int,
    "context-parallel-size": int,
    "expert-model-parallel-size": int,
    "expert-tensor-parallel-size": int,
    "sequence-parallel": bool,
    "recompute-granularity": str,
    "recompute-method": str,
    "recompute-num-layers": int,
    "attention-dropout": float,
    "hidden-dropout": float,
    "accumulate-allreduce-grads-in-fp32": bool,
    "attention-softmax-in-fp32": bool,
    "attention-backend": str,
    "use-flash-attn": bool,  # Megatron's older spelling of --attention-backend flash
    "no-gradient-accumulation-fusion": bool,
    # The model's architecture, as vime's scripts/models/*.sh give it: checked against config.json before anything
    # loads (vime_engine/train/megatron_model_flags.py), never applied over it.
    "swiglu": bool,
    "num-layers": int,
    "hidden-size": int,
    "ffn-hidden-size": int,
    "num-attention-heads": int,
    "group-query-attention": bool,
    "num-query-groups": int,
    "kv-channels": int,
    "vocab-size": int,
    "max-position-embeddings": int,
    "use-rotary-position-embeddings": bool,
    "position-embedding-type": str,
    "rotary-base": float,
    "use-rope-scaling": bool,
    "rotary-scaling-factor": float,
    "disable-bias-linear": bool,
    "add-qkv-bias": bool,
    "normalization": str,
    "norm-epsilon": float,
    "qk-layernorm": bool,
    "untie-embeddings-and-output-weights": bool,
    "num-experts": int,
    "moe-router-topk": int,
    "moe-ffn-hidden-size": int,
    "moe-router-score-function": str,
    "moe-router-load-balancing-type": str,
    "moe-layer-freq": str,
    "moe-router-pre-softmax": bool,
    "moe-router-topk-scaling-factor": float,
    "moe-shared-expert-intermediate-size": int,
    "moe-router-enable-expert-bias": bool,
    "moe-router-bias-update-rate": float,
    "rotary-percent": float,
    # DeepSeek-V3's and GLM-4.5's (built by Megatron-Bridge: --megatron-to-hf-mode bridge), checked the same way.
    "multi-latent-attention": bool,
    "q-lora-rank": int,
    "kv-lora-rank": int,
    "qk-head-dim": int,
    "qk-pos-emb-head-dim": int,
    "v-head-dim": int,
    "mscale": float,
    "mscale-all-dim": float,
    "moe-router-num-groups": int,
    "moe-router-group-topk": int,
    "mtp-num-layers": int,
    "no-rope-fusion": bool,  # a Transformer Engine kernel choice (ParallelLayout.rope_fusion)
    # How Megatron runs the MoE layers (vime_engine/train/megatron_layout.MoESettings).
    "moe-token-dispatcher-type": str,
    "moe-router-dtype": str,
    "moe-token-drop-policy": str,
    "moe-grouped-gemm": bool,
    "moe-permute-fusion": bool,
}
PARALLEL_FLAGS = [f for f in MEGATRON_FLAGS if f.endswith("parallel-size")]


def typed_megatron_value(name: str, value: Any) -> Any:
    """A Megatron pass-through flag's value as its declared type (flags arrive as text: `--sequence-parallel=false`
    must be False, `--recompute-num-layers 4` the int 4)."""
    kind = MEGATRON_FLAGS.get(name)
    if kind is None or value is None:
        return value
    if kind is bool:
        switch = switch_value(value)
        if switch is None:
            raise ConfigError(f"--{name} {value!r}: expected true or false")
        return switch
    if kind is str:
        return str(value)
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value) if kind is float else int(str(value))
    except ValueError:
        raise ConfigError(f"--{name} {value!r}: expected {'an integer' if kind is int else 'a number'}") from None
