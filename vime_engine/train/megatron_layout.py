"""Megatron's parallel layout and settings as typed values, read once from its pass-through flags.

No Megatron import at module level: the HF mapping (megatron_hf.py) and the model (megatron_model.py) both read
it, and the mapping must stay importable where Megatron is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# --megatron-to-hf-mode: how weights cross between HF tensors and the Megatron model (megatron_model.hf_mapping).
MegatronToHFMode = Literal["raw", "bridge"]
# model_type → family: the families the engine's own mapping lacks, whose Megatron model Megatron-Bridge's provider
# builds (multi-latent attention, sigmoid routing with an expert bias, shared experts): bridge mode only.
BRIDGE_FAMILIES = {"deepseek_v3": "DeepSeek-V3", "glm4_moe": "GLM-4.5"}


class MegatronSetupError(ValueError):
    """A Megatron parallel layout or setting this engine cannot run; the message names the flag."""


# Megatron's token dispatchers that run on its local (non-Transformer-Engine) MoE layers, over any process group
# backend; "flex" needs DeepEP or HybridEP kernels (CUDA).
TOKEN_DISPATCHERS = ("alltoall", "allgather")


@dataclass(frozen=True)
class MoESettings:
    """How Megatron runs a mixture-of-experts model's layers (the model itself comes from config.json).

    grouped_gemm and permute_fusion are kernel choices of Transformer Engine: the same experts and the same
    checkpoint layout, computed in one grouped GEMM / fused permutation where TE provides them
    (`megatron_hf.transformer_config` turns them off where it does not, and says so once).
    """

    token_dispatcher: str = "alltoall"  # vime's scripts' choice (Megatron's own default is allgather)
    router_dtype: str | None = None  # fp32 / fp64: the router's logits and softmax in that precision
    aux_loss_coeff: float = 0.0  # --moe-aux-loss-coeff: Megatron's Switch loss of every MoE layer
    token_drop_policy: str = "probs"
    grouped_gemm: bool = False
    permute_fusion: bool = False
    # --moe-router-bias-update-rate: how far each step moves the expert bias (BRIDGE_FAMILIES' aux-loss-free
    # balancing); None: the provider's (Megatron's 1e-3 for DeepSeek-V3, 0 for GLM-4.5).
    expert_bias_update_rate: float | None = None

    @classmethod
    def from_flags(cls, flags: dict[str, Any], aux_loss_coeff: float = 0.0) -> MoESettings:
        settings = cls(
            token_dispatcher=flags.get("moe-token-dispatcher-type") or "alltoall",
            router_dtype=flags.get("moe-router-dtype"),
            aux_loss_coeff=aux_loss_coeff,
            token_drop_policy=flags.get("moe-token-drop-policy") or "probs",
            grouped_gemm=bool(flags.get("moe-grouped-gemm", False)),
            permute_fusion=bool(flags.get("moe-permute-fusion", False)),
            expert_bias_update_rate=flags.get("moe-router-bias-update-rate"),
        )
        expert = int(flags.get("expert-model-parallel-size") or 1)
        if settings.token_dispatcher == "allgather" and expert > 1:
            raise MegatronSetupError(
                f"--moe-token-dispatcher-type allgather with --expert-model-parallel-size {expert}: that dispatcher "
                "gathers equal blocks of tokens from every expert-parallel rank, and each rank's micro-batches are "
                "padded to their own longest sample here; use alltoall")
        if settings.token_dispatcher not in TOKEN_DISPATCHERS:
            raise MegatronSetupError(
                f"--moe-token-dispatcher-type {settings.token_dispatcher}: the engine's MoE layers dispatch with "
                f"{' or '.join(TOKEN_DISPATCHERS)} (flex needs DeepEP / HybridEP kernels, not built here)")
        if settings.router_dtype not in (None, "fp32", "fp64"):
            raise MegatronSetupError(f"--moe-router-dtype {settings.router_dtype}: expected fp32 or fp64")
        if settings.token_drop_policy not in ("probs", "position"):
            raise MegatronSetupError(
                f"--moe-token-drop-policy {settings.token_drop_policy}: expected probs or position")
        return settings


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron's parallel flags (`cfg.megatron`, keyed by flag name) as typed values."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: int | None = None
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    attention_softmax_in_fp32: bool | None = None  # None: the provider's own choice
    attention_backend: str | None = None  # megatron.core.transformer.enums.AttnBackend name; None: Megatron's
    # Gradients reduced across data-parallel ranks in fp32 (exact reductions) unless turned off.
    grad_reduce_in_fp32: bool = True
    gradient_accumulation_fusion: bool = True  # where Transformer Engine's fused kernels exist
    rope_fusion: bool = True  # likewise; --no-rope-fusion turns it off
    moe: MoESettings = field(default_factory=MoESettings)

    @classmethod
    def from_flags(cls, flags: dict[str, Any], moe_aux_loss_coeff: float = 0.0) -> ParallelLayout:
        backend = flags.get("attention-backend")
        if flags.get("use-flash-attn"):
            if backend not in (None, "flash"):
                raise MegatronSetupError(f"--use-flash-attn asks for --attention-backend flash, and "
                                         f"--attention-backend {backend} asks for another: give one of them")
            backend = "flash"
        layout = cls(
            tensor=int(flags.get("tensor-model-parallel-size") or 1),
            pipeline=int(flags.get("pipeline-model-parallel-size") or 1),
            context=int(flags.get("context-parallel-size") or 1),
            expert=int(flags.get("expert-model-parallel-size") or 1),
            expert_tensor=flags.get("expert-tensor-parallel-size"),
            sequence_parallel=bool(flags.get("sequence-parallel", False)),
            recompute_granularity=flags.get("recompute-granularity"),
            recompute_method=flags.get("recompute-method"),
            recompute_num_layers=flags.get("recompute-num-layers"),
            # RL needs the same function for old and new log-probs: dropout off unless asked for.
            attention_dropout=float(flags.get("attention-dropout") or 0.0),
            hidden_dropout=float(flags.get("hidden-dropout") or 0.0),
            attention_softmax_in_fp32=flags.get("attention-softmax-in-fp32"),
            attention_backend=backend,
            grad_reduce_in_fp32=flags.get("accumulate-allreduce-grads-in-fp32", True),
            gradient_accumulation_fusion=not flags.get("no-gradient-accumulation-fusion", False),
            rope_fusion=not flags.get("no-rope-fusion", False),
            moe=MoESettings.from_flags(flags, moe_aux_loss_coeff),
        )
        if layout.attention_backend is not None:
            from megatron.core.transformer.enums import AttnBackend

            if layout.attention_backend not in AttnBackend.__members__:
                raise MegatronSetupError(
                    f"--attention-backend {layout.attention_backend!r}: expected one of "
                    f"{', '.join(AttnBackend.__members__)}"
                )
        if layout.context != 1:
            raise MegatronSetupError(
                "--context-parallel-size > 1 is not supported yet by the Megatron backend "
                "(it trains on padded batches; context parallelism needs sequence-split packing)"
            )
        if layout.sequence_parallel and layout.tensor == 1:
            raise MegatronSetupError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        return layout

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline * self.context
