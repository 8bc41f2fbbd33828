"""Megatron's model-architecture flags, as vime's `scripts/models/*.sh` set them, checked against config.json.

The engine builds every model from its HF config (vime_engine/train/megatron_hf.py maps it to Megatron's
TransformerConfig), so these flags describe the model; they never change it. A flag that agrees with
config.json passes; one that disagrees is refused, naming the flag, the HF field and both values; one that asks
for an architecture the engine does not build (learned absolute positions, LayerNorm) is refused with the reason.

What each flag means is Megatron's: without --group-query-attention Megatron builds one key/value head per
attention head, so --num-query-groups counts only with it; --disable-bias-linear drops the bias of every
linear layer except the q/k/v projections' where --add-qkv-bias keeps them; --moe-layer-freq N makes layers 0, N,
2N, … MoE layers (HF's decoder_sparse_step N makes layers N-1, 2N-1, … MoE layers), or gives the pattern itself
("[0]*1+[1]*46", "[1, 1, 0]").

DeepSeek-V3 and GLM-4.5 (BRIDGE_FAMILIES, built by Megatron-Bridge under --megatron-to-hf-mode bridge) are described
by their own flags too: multi-latent attention's ranks and head sizes, sigmoid routing with an expert bias, group-limited
routing (--moe-router-num-groups, --moe-router-group-topk), shared experts, the dense first layers
(first_k_dense_replace), YaRN's mscale, multi-token prediction (--mtp-num-layers: 0 or absent leaves the checkpoint's
MTP layers out of the policy; training them is refused). Their routers score by sigmoid, where Megatron reads
--moe-router-pre-softmax not at all (it picks softmax's order only), so that flag passes either way for them.

The expert-parallel layout is checked against the model here too (`check_expert_layout`): its experts must split
over --expert-model-parallel-size, and Megatron's rules for MoE layers hold.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vime_engine.train.megatron_layout import BRIDGE_FAMILIES


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
        return self.get("num_experts") or self.get("num_local_experts") or self.get("n_routed_experts")

    @property
    def bridge_family(self) -> bool:
        """DeepSeek-V3 or GLM-4.5: sigmoid routing with an expert bias, shared experts, the first layers dense."""
        return self.get("model_type") in BRIDGE_FAMILIES

    @property
    def moe_layer_pattern(self) -> tuple[int, ...] | None:
        """Per layer: 1 a MoE layer, 0 a dense one (None for a dense model)."""
        if not self.num_experts:
            return None
        if self.bridge_family:
            layers, dense = self.config["num_hidden_layers"], self.get("first_k_dense_replace") or 0
            return (0,) * dense + (1,) * (layers - dense)
        return moe_layer_pattern(self.config["num_hidden_layers"], self.get("decoder_sparse_step") or 1,
                                 self.get("mlp_only_layers") or [])

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
        """Biases on the attention output and MLP projections (Qwen2's and GLM-4.5's attention_bias covers q/k/v
        only)."""
        o_proj = self.get("model_type") not in ("qwen2", "glm4_moe") and bool(self.get("attention_bias", False))
        return o_proj or bool(self.get("mlp_bias", False))

    @property
    def qk_norm(self) -> bool:
        """Megatron's qk_layernorm: Qwen3's per-head q/k RMSNorm, GLM-4.5's (use_qk_norm), and under multi-latent
        attention the RMSNorms of the q and kv latents (DeepSeek-V3's q_a_layernorm, kv_a_layernorm)."""
        return (self.get("model_type") in ("qwen3", "qwen3_moe") or bool(self.get("use_qk_norm", False))
                or self.mla)

    @property
    def mla(self) -> bool:
        return self.get("kv_lora_rank") is not None

    @property
    def score_function(self) -> str:
        return "sigmoid" if self.bridge_family else "softmax"

    @property
    def shared_expert_size(self) -> int:
        if self.bridge_family:
            return (self.get("n_shared_experts") or 0) * self.config["moe_intermediate_size"]
        return self.get("shared_expert_intermediate_size") or 0


@dataclass(frozen=True)
class Rule:
    """One flag: the config.json field it describes and the value the model has there."""

    hf_field: str | Callable[[HFView], str]  # the field's name, or how to name it for this model
    model_value: Callable[[HFView], Any]

    def field_of(self, model: HFView) -> str:
        return self.hf_field(model) if callable(self.hf_field) else self.hf_field


def _same(flag_value: Any, model_value: Any) -> bool:
    if isinstance(flag_value, float) or isinstance(model_value, float):
        return model_value is not None and math.isclose(float(flag_value), float(model_value), rel_tol=1e-9)
    return flag_value == model_value


def moe_layer_pattern(num_layers: int, sparse_step: int, dense_layers: list[int]) -> tuple[int, ...]:
    """HF's Qwen-MoE rule for which layers have experts: layer i unless listed in mlp_only_layers, and only where
    (i + 1) is a multiple of decoder_sparse_step. 1 marks a MoE layer, 0 a dense MLP."""
    return tuple(0 if i in dense_layers or (i + 1) % sparse_step else 1 for i in range(num_layers))


def megatron_layer_pattern(value: Any, num_layers: int) -> tuple[int, ...]:
    """--moe-layer-freq as Megatron reads it: an integer N (layers 0, N, 2N, … have experts) or a Python list
    expression of 0s and 1s, one per layer, built from list literals, `*` and `+` (vime's scripts write
    "[1,1,…]" and "[0]*1+[1]*46"). Evaluated without eval(); anything else is refused."""
    if isinstance(value, int) or str(value).strip().isdigit():
        every = int(value)
        if every < 1:
            raise ModelFlagMismatch(f"--moe-layer-freq {value}: expected a positive integer or a list of 0/1")
        return tuple(1 if i % every == 0 else 0 for i in range(num_layers))

    def evaluate(node: ast.AST) -> Any:
        if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and e.value in (0, 1) for e in node.elts):
            return [e.value for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = evaluate(node.left), evaluate(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError

    try:
        pattern = evaluate(ast.parse(str(value), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        pattern = None
    if not isinstance(pattern, list):
        raise ModelFlagMismatch(f"--moe-layer-freq {value}: expected an integer or a list of 0/1 per layer such as "
                                "[1,1] or [0]*1+[1]*46")
    return tuple(pattern)


RULES: dict[str, Rule] = {
    "num-layers": Rule("num_hidden_layers", lambda m: m.get("num_hidden_layers")),
    "hidden-size": Rule("hidden_size", lambda m: m.get("hidden_size")),
    "ffn-hidden-size": Rule("intermediate_size", lambda m: m.get("intermediate_size")),
    "num-attention-heads": Rule("num_attention_heads", lambda m: m.heads),
    # Megatron's multi-latent attention reads its own head sizes, not kv-channels: vime's DeepSeek-V3 script gives it
    # the value heads' size.
    "kv-channels": Rule(lambda m: "v_head_dim (multi-latent attention)" if m.mla else "head_dim",
                        lambda m: m.get("v_head_dim") if m.mla else m.head_dim),
    "vocab-size": Rule("vocab_size", lambda m: m.get("vocab_size")),
    "max-position-embeddings": Rule("max_position_embeddings", lambda m: m.get("max_position_embeddings")),
    "norm-epsilon": Rule("rms_norm_eps", lambda m: m.get("rms_norm_eps")),
    "rotary-base": Rule("rope_theta", lambda m: m.rope_theta),
    "rotary-scaling-factor": Rule("rope_scaling.factor", lambda m: m.rope.get("factor")),
    "swiglu": Rule("hidden_act (silu: a gated SiLU MLP)", lambda m: m.get("hidden_act", "silu") in ("silu", "swish")),
    "qk-layernorm": Rule("model_type (Qwen3's per-head q/k RMSNorm; GLM-4.5's use_qk_norm; DeepSeek-V3's latent norms)",
                         lambda m: m.qk_norm),
    "add-qkv-bias": Rule("q/k/v projection biases (Qwen2, attention_bias)", lambda m: m.qkv_bias),
    "disable-bias-linear": Rule("attention_bias / mlp_bias", lambda m: not m.other_linear_bias),
    "untie-embeddings-and-output-weights": Rule("tie_word_embeddings", lambda m: not m.get("tie_word_embeddings", False)),
    "use-rope-scaling": Rule("rope_scaling", lambda m: m.rope_type != "default"),
    "use-rotary-position-embeddings": Rule("rotary position embeddings (every mapped family)", lambda m: True),
    # Mixture of experts (vime's scripts/models/qwen3-30B-A3B.sh); a dense model has none of these fields.
    "num-experts": Rule("num_experts", lambda m: m.num_experts),
    "moe-router-topk": Rule("num_experts_per_tok", lambda m: m.get("num_experts_per_tok")),
    "moe-ffn-hidden-size": Rule("moe_intermediate_size", lambda m: m.get("moe_intermediate_size")),
    "moe-router-pre-softmax": Rule("norm_topk_prob (pre-softmax: the top-k probabilities are not renormalised)",
                                   lambda m: not m.get("norm_topk_prob", False)),
    "moe-router-topk-scaling-factor": Rule("routed_scaling_factor (Qwen3-MoE: none, 1.0)",
                                           lambda m: float(m.get("routed_scaling_factor") or 1.0)),
    "moe-shared-expert-intermediate-size": Rule(
        "shared_expert_intermediate_size (Qwen3-MoE: no shared expert; DeepSeek-V3, GLM-4.5: n_shared_experts × "
        "moe_intermediate_size)", lambda m: m.shared_expert_size),
    "rotary-percent": Rule("partial_rotary_factor", lambda m: float(m.get("partial_rotary_factor") or 1.0)),
    "moe-router-score-function": Rule("model_type (Qwen3-MoE scores experts by softmax; DeepSeek-V3 and GLM-4.5 by "
                                      "sigmoid)", lambda m: m.score_function),
    "moe-router-enable-expert-bias": Rule("model_type (DeepSeek-V3's and GLM-4.5's e_score_correction_bias, their "
                                          "aux-loss-free balancing)", lambda m: m.bridge_family),
    "moe-router-num-groups": Rule("n_group", lambda m: m.get("n_group")),
    "moe-router-group-topk": Rule("topk_group", lambda m: m.get("topk_group")),
    "multi-latent-attention": Rule("kv_lora_rank (multi-latent attention)", lambda m: m.mla),
    "q-lora-rank": Rule("q_lora_rank", lambda m: m.get("q_lora_rank")),
    "kv-lora-rank": Rule("kv_lora_rank", lambda m: m.get("kv_lora_rank")),
    "qk-head-dim": Rule("qk_nope_head_dim", lambda m: m.get("qk_nope_head_dim")),
    "qk-pos-emb-head-dim": Rule("qk_rope_head_dim", lambda m: m.get("qk_rope_head_dim")),
    "v-head-dim": Rule("v_head_dim", lambda m: m.get("v_head_dim")),
    "mscale": Rule("rope_scaling.mscale (YaRN; 1.0 without it)", lambda m: float(m.rope.get("mscale", 1.0))),
    "mscale-all-dim": Rule("rope_scaling.mscale_all_dim (YaRN; 0 without it)",
                           lambda m: float(m.rope.get("mscale_all_dim", 0.0))),
}
# Flags that ask for a router the model does not have, refused when given.
REFUSED: dict[str, tuple[Callable[[HFView], bool], str]] = {
    "moe-router-bias-update-rate": (
        lambda m: not m.bridge_family,
        "it moves the expert bias of --moe-router-enable-expert-bias (DeepSeek-V3's and GLM-4.5's aux-loss-free "
        "balancing); this model's router has none"),
}
# Megatron reads --moe-router-pre-softmax under softmax scores only: for sigmoid-scored models either value passes.
_SOFTMAX_ONLY = ("moe-router-pre-softmax",)
# Flags that choose among architectures: the value the engine builds, and why another is refused.
CHOICES: dict[str, tuple[str, str]] = {
    "normalization": ("RMSNorm", "the engine builds RMSNorm models only (Llama, Qwen2, Qwen3)"),
    "position-embedding-type": ("rope", "the engine builds rotary position embeddings only (learned absolute "
                                        "positions are not built)"),
    "moe-router-load-balancing-type": ("aux_loss", "every backend adds the Switch Transformer loss (aux_loss) of "
                                                   "each micro-batch; --moe-aux-loss-coeff 0 turns it off"),
}
# Load-balancing losses that, with --moe-aux-loss-coeff 0 (vime's DeepSeek-V3 and GLM-4.5 scripts), add nothing: named
# then, they change nothing, so they pass.
_UNWEIGHTED_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
MODEL_FLAGS = (*RULES, *CHOICES, *REFUSED, "group-query-attention", "num-query-groups", "moe-layer-freq",
               "mtp-num-layers")


def check_model_flags(flags: dict[str, Any], config: dict[str, Any], where: str, aux_loss_coeff: float = 0.0) -> None:
    """Raise ModelFlagMismatch for the first flag in `flags` (Megatron flags by name) that does not describe the
    model whose config.json is `config` (read from `where`), --moe-aux-loss-coeff being `aux_loss_coeff`. Flags
    not given are not checked."""
    model = HFView(config)
    balancing = flags.get("moe-router-load-balancing-type")
    if aux_loss_coeff == 0 and balancing in _UNWEIGHTED_LOSSES:
        flags = {k: v for k, v in flags.items() if k != "moe-router-load-balancing-type"}
    for flag, (refused, why) in REFUSED.items():
        if flags.get(flag) is not None and flags[flag] is not False and refused(model):
            shown = "" if flags[flag] is True else f" {flags[flag]}"
            raise ModelFlagMismatch(f"--{flag}{shown}: {why}; drop the flag")
    for flag, (built, why) in CHOICES.items():
        if flag in flags and str(flags[flag]).lower() != built.lower():
            raise ModelFlagMismatch(f"--{flag} {flags[flag]}: {why}; give --{flag} {built} or drop it")
    use_rope = flags.get("use-rotary-position-embeddings")
    if use_rope is False:
        raise ModelFlagMismatch(f"--use-rotary-position-embeddings false: {CHOICES['position-embedding-type'][1]}")
    for flag, rule in RULES.items():
        if flag in _SOFTMAX_ONLY and model.score_function != "softmax":
            continue
        if flag in flags and not _same(flags[flag], rule.model_value(model)):
            _refuse(flag, flags[flag], rule.field_of(model), rule.model_value(model), where)
    if "group-query-attention" in flags or "num-query-groups" in flags:
        groups = flags.get("num-query-groups", 1) if flags.get("group-query-attention") else model.heads
        if groups != model.kv_heads:
            shown = (f"--group-query-attention --num-query-groups {flags.get('num-query-groups', 1)}"
                     if flags.get("group-query-attention") else "no --group-query-attention (one group per head)")
            raise ModelFlagMismatch(
                f"{shown} gives {groups} key/value head(s); config.json num_key_value_heads = {model.kv_heads} "
                f"({where}); the model flags describe the model and never change it: fix them or drop them")
    if "moe-layer-freq" in flags:
        _check_moe_layer_freq(flags["moe-layer-freq"], model, where)
    if flags.get("mtp-num-layers"):
        _check_mtp_layers(flags["mtp-num-layers"], model, where)


def _check_mtp_layers(value: int, model: HFView, where: str) -> None:
    """--mtp-num-layers N > 0 asks to build and train the checkpoint's multi-token-prediction layers (slime builds them
    only with it); 0 or no flag leaves them out of the policy, their tensors carried unchanged (megatron_mtp)."""
    found = model.get("num_nextn_predict_layers") or 0
    if value != found:
        raise ModelFlagMismatch(
            f"--mtp-num-layers {value} disagrees with config.json num_nextn_predict_layers = {found} ({where}); the "
            "model flags describe the model and never change it: drop the flag")
    raise ModelFlagMismatch(
        f"--mtp-num-layers {value}: training the checkpoint's {found} multi-token-prediction layer(s) is not wired "
        "(the RL loss would not reach them and the weight sync would not send them); drop the flag: the policy is "
        "then built without them, and --save-hf and vimeflow convert carry their weights unchanged")


def _check_moe_layer_freq(value: Any, model: HFView, where: str) -> None:
    layers = model.config.get("num_hidden_layers", 0)
    given, found = megatron_layer_pattern(value, layers), model.moe_layer_pattern
    if found is None:
        raise ModelFlagMismatch(f"--moe-layer-freq {value}: the model has no experts (no num_experts in {where}); "
                                "drop the flag")
    if given != found:
        raise ModelFlagMismatch(
            f"--moe-layer-freq {value} gives the MoE layers {_layers(given)}; config.json decoder_sparse_step = "
            f"{model.get('decoder_sparse_step') or 1}, mlp_only_layers = {model.get('mlp_only_layers') or []} give "
            f"{_layers(found)} ({where}); the model flags describe the model and never change it: fix or drop it")


def _layers(pattern: tuple[int, ...]) -> str:
    chosen = [i for i, moe in enumerate(pattern) if moe]
    return f"{chosen} of {len(pattern)}" if len(chosen) < len(pattern) else f"all {len(pattern)}"


def check_expert_layout(flags: dict[str, Any], config: dict[str, Any], where: str) -> None:
    """Megatron's expert-parallel layout (`flags`: its flags by name) for the model of `config`: experts to split,
    as many on every expert-parallel rank, and sequence parallelism under tensor parallelism (Megatron's rule
    for MoE layers)."""
    model = HFView(config)
    expert, tensor = flags.get("expert-model-parallel-size") or 1, flags.get("tensor-model-parallel-size") or 1
    expert_tensor = flags.get("expert-tensor-parallel-size")
    if not model.num_experts:
        if expert > 1 or expert_tensor not in (None, tensor):
            shown = f"--expert-model-parallel-size {expert}" if expert > 1 else \
                f"--expert-tensor-parallel-size {expert_tensor}"
            raise ModelFlagMismatch(f"{shown}: the model has no experts to split (no num_experts in {where}); "
                                    "drop the flag or give a mixture-of-experts model")
        return
    if model.num_experts % expert:
        raise ModelFlagMismatch(
            f"--expert-model-parallel-size {expert}: the model's {model.num_experts} experts (config.json "
            f"num_experts, {where}) do not split evenly over {expert} ranks; use a divisor of {model.num_experts}")
    if tensor > 1 and not flags.get("sequence-parallel"):
        raise ModelFlagMismatch(
            f"--tensor-model-parallel-size {tensor} with a mixture-of-experts model needs --sequence-parallel "
            "(Megatron's MoE layers train under tensor parallelism only with it)")


def _refuse(flag: str, given: Any, field: str, found: Any, where: str) -> None:
    if isinstance(given, bool):
        state = "has" if found else "does not have"
        raise ModelFlagMismatch(
            f"--{flag} {'true' if given else 'false'}: the model {state} it (config.json {field}, {where}); the "
            f"model flags describe the model and never change it: drop the flag")
    raise ModelFlagMismatch(
        f"--{flag} {given} disagrees with config.json {field} = {found} ({where}); the model flags describe the "
        f"model and never change it: give --{flag} {found} or drop the flag")
