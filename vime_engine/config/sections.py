"""EngineConfig: one typed, validated configuration for the RL engine.

Every field is also a vime/slime-style command-line flag: the field `rollout_batch_size` is the flag
`--rollout-batch-size`, so a vime user's launch script carries over. Sections group the fields by the part of
the engine that reads them; flag names are unique across sections. YAML files use the same flat names
(`rollout-batch-size: 16` or `rollout_batch_size: 16`); flags given on the command line win over the file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flag and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    hf_checkpoint: str = Field(description="HF model directory (local path) to start from")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="training and rollout dtype")


class DataConfig(_Section):
    prompt_data: str = Field(description="prompt dataset, .jsonl or .parquet")
    input_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str | None = None
    apply_chat_template: bool = Field(False, description="render prompts with the tokenizer's chat template")
    rollout_shuffle: bool = Field(False, description="shuffle the prompts every epoch")
    rollout_seed: int = 42
    rollout_max_prompt_len: int | None = Field(
        None, ge=1, description="drop prompts longer than this many tokens (chat template applied), train and eval"
    )


class RolloutConfig(_Section):
    num_rollout: int = Field(1, ge=0, description="number of rollout → train iterations; 0 = eval only")
    rollout_batch_size: int = Field(8, ge=1, description="prompts per rollout")
    n_samples_per_prompt: int = Field(4, ge=1)
    rollout_max_response_len: int = Field(64, ge=1)
    rollout_temperature: float = Field(1.0, gt=0)
    rollout_top_p: float = Field(1.0, gt=0, le=1)
    rollout_top_k: int = Field(-1, description="-1 disables top-k")
    over_sampling_batch_size: int | None = Field(None, ge=1, description="prompts generated per draw when filtering")
    dynamic_sampling_filter_path: str | None = Field(
        None, description="keep a group? `(args, samples) -> bool | DynamicFilterOutput` (vime) or `(group) -> bool`"
    )
    # vime's rollout hooks (module:function or file.py:function; vime_engine/vime_hooks.py calls them).
    buffer_filter_path: str | None = Field(
        None, description="`(args, rollout_id, buffer, num_samples) -> groups`: which cut-off groups resume first"
    )
    rollout_sample_filter_path: str | None = Field(
        None, description="`(args, groups) -> None`: sets sample.remove_sample to keep a sample out of the loss"
    )
    rollout_all_samples_process_path: str | None = Field(
        None, description="`(args, all_groups, data_source) -> None`: sees every group, filtered ones too"
    )
    rollout_function_path: str | None = Field(
        None, description="vime's whole-rollout function; refused: our rollout runs vLLM in-process"
    )
    partial_rollout: bool = Field(
        False, description="stop generating once the batch is full; unfinished groups continue next rollout"
    )
    custom_generate_function_path: str | None = Field(
        None, description="vime's `async (args, sample, sampling_params) -> Sample` generating each sample "
        "(multi-turn, tools) on the engine through args.rollout_engine; see vime_engine/rollout/custom_generate.py"
    )
    rollout_max_turns: int | None = Field(None, ge=1, description="the model's turns a multi-turn sample may hold")
    rollout_max_context_len: int | None = Field(
        None, ge=2, description="tokens a multi-turn sample may hold: prompt, every turn and every tool reply"
    )
    rollout_num_gpus: int | None = None
    rollout_num_gpus_per_engine: int = 1
    # slime's names: watch the disaggregated engines, restart a dead one and re-generate its groups.
    use_fault_tolerance: bool = Field(
        False, description="restart a rollout engine that dies or stops answering, reload the current weights "
        "into it and generate its unfinished groups again (the same seeds: the same samples)"
    )
    rollout_health_check_interval: float = Field(30.0, gt=0, description="seconds between engine health checks")
    rollout_health_check_timeout: float = Field(
        30.0, gt=0, description="seconds an engine may take to answer a health check before it is restarted"
    )
    rollout_health_check_first_wait: float = Field(
        0.0, ge=0, description="seconds after an engine (re)starts before its health checks begin"
    )
    rollout_max_engine_restarts: int = Field(
        3, ge=0, description="engine restarts a run may make; one more death ends it with the retryable exit code"
    )
    vllm_gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    vllm_max_model_len: int | None = None
    vllm_kv_cache_gb: float = Field(1.0, gt=0, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)")
    # "auto" = the device's best (vime_engine/rollout/vllm_engine.py: device_engine_kwargs); a value given wins.
    vllm_enforce_eager: bool | Literal["auto"] = Field(
        "auto", description="run vLLM without CUDA / ACL graphs; auto: eager on CPU, graphs on accelerators. "
        "true on an accelerator costs decode speed; false on CPU compiles the model first (a slow start)"
    )
    vllm_enable_prefix_caching: bool | Literal["auto"] = Field(
        "auto", description="share the KV blocks of a prompt's n samples; auto: off on CPU, on on accelerators. "
        "true on CPU makes samples depend on the cache (log-probs up to 3e-5 apart from it off); false on an "
        "accelerator costs one prefill per sample instead of per prompt"
    )
    vllm_enable_chunked_prefill: bool | Literal["auto"] = Field(
        "auto", description="split long prompts across engine steps; auto: off on CPU (whole prompts keep a "
        "sample's draws independent of the batch; CPU cannot run it with seeded sampling), on on accelerators. "
        "false on an accelerator costs throughput and needs --vllm-max-num-batched-tokens >= the model length"
    )
    vllm_max_num_batched_tokens: int | Literal["auto"] = Field(
        "auto", description="tokens per engine step; auto: max(model length, 16384) without chunked prefill, "
        "vLLM's own budget with it"
    )

    @field_validator("vllm_enforce_eager", "vllm_enable_prefix_caching", "vllm_enable_chunked_prefill",
                     "vllm_max_num_batched_tokens", mode="before")
    @classmethod
    def _auto_or_value(cls, value: Any, info: ValidationInfo) -> Any:
        """One clear message per flag (pydantic would report each member of the union)."""
        text = str(value).strip().lower()
        if text == "auto":
            return "auto"
        if info.field_name == "vllm_max_num_batched_tokens":
            if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
                raise ValueError(f"--vllm-max-num-batched-tokens {value!r}: expected a positive integer or auto")
            return int(text)
        if isinstance(value, bool) or text in _TRUE + _FALSE:
            return value if isinstance(value, bool) else text in _TRUE
        raise ValueError(f"{_flag(info.field_name)} {value!r}: expected true, false or auto")


class RewardConfig(_Section):
    rm_type: str = Field("math", description="math | gsm8k | dapo | deepscaler | code | remote_rm")
    custom_rm_path: str | None = Field(None, description="module:function or file.py:function")
    rm_url: str | None = Field(None, description="reward server for remote_rm (--rm-type or --eval-rm-type)")
    group_rm: bool = Field(False, description="call --custom-rm-path once per group: `async (args, samples)`")
    custom_reward_post_process_path: str | None = Field(
        None, description="`(args, samples) -> (raw_rewards, rewards)`: replaces the group normalisation"
    )


AdvantageEstimator = Literal["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
KLType = Literal["k1", "k2", "k3", "low_var_kl"]


class AlgorithmConfig(_Section):
    advantage_estimator: AdvantageEstimator = "grpo"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: KLType = "low_var_kl"
    kl_coef: float = Field(0.0, description="KL penalty folded into the reward (reinforce++ / ppo)")
    entropy_coef: float = 0.0
    eps_clip: float = Field(0.2, ge=0)
    eps_clip_high: float | None = Field(None, ge=0, description="defaults to --eps-clip")
    eps_clip_c: float | None = Field(None, gt=1, description="dual-clip constant (> 1)")
    normalize_advantages: bool = False
    disable_grpo_std_normalization: bool = False
    use_tis: bool = False
    tis_clip: float = Field(2.0, gt=0)
    calculate_per_token_loss: bool = False
    gamma: float = Field(1.0, ge=0, le=1)
    lambd: float = Field(1.0, ge=0, le=1)
    value_clip: float = Field(0.2, gt=0)
    custom_advantage_function_path: str | None = Field(
        None, description="`(args, rollout_data) -> None`: sets rollout_data['advantages'] and ['returns']"
    )


class TrainConfig(_Section):
    train_backend: Literal["torch", "megatron"] = "torch"
    global_batch_size: int | None = Field(None, ge=1, description="samples per optimizer step")
    num_steps_per_rollout: int | None = Field(None, ge=1)
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    micro_batch_size: int | None = Field(
        None, ge=1, description="samples per micro-batch; unset: micro-batches by token budget (--max-tokens-per-gpu)")
    balance_data: bool = Field(False, description="even out tokens across data-parallel ranks in each optimizer step")
    optimizer: Literal["adam"] = "adam"
    lr: float = Field(1e-6, gt=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_iters: int = Field(0, ge=0)
    lr_decay_iters: int | None = Field(None, ge=1, description="optimizer steps of the decay; default: the whole run")
    min_lr: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = Field(1.0, ge=0, description="0 disables gradient clipping")
    seed: int = 1234


class PlacementConfig(_Section):
    colocate: bool = Field(False, description="trainer and rollout engine share one actor (and device)")
    async_rollout: bool = Field(False, description="generate rollout i+1 while training on i (not colocated)")
    actor_num_nodes: int = Field(1, ge=1)
    actor_num_gpus_per_node: int = Field(1, ge=1)
    ray_address: str | None = Field(None, description="Ray cluster address; default: a private local cluster")
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    weight_sync: Literal["object_store", "broadcast"] = Field(
        "object_store", description="disaggregated weight sync: Ray's object store or a bucketed collective broadcast"
    )
    weight_sync_bucket_mb: float = Field(64, gt=0)


class CheckpointConfig(_Section):
    save: str | None = Field(None, description="checkpoint directory")
    save_interval: int | None = Field(None, ge=1)
    load: str | None = None
    ref_load: str | None = Field(None, description="reference model for the KL term (default: --hf-checkpoint)")
    start_rollout_id: int | None = Field(None, ge=0)
    keep_last: int | None = Field(None, ge=1)
    save_hf: str | None = Field(None, description="export the final weights as an HF directory")


class EvalConfig(_Section):
    eval_prompt_data: list[str] | None = Field(None, description="NAME PATH [NAME PATH ...]")
    eval_interval: int | None = Field(None, ge=1)
    n_samples_per_eval_prompt: int = Field(1, ge=1)
    eval_max_response_len: int | None = None
    eval_temperature: float | None = None
    eval_top_p: float | None = None
    eval_input_key: str | None = None
    eval_label_key: str | None = None
    eval_rm_type: str | None = None
    eval_function_path: str | None = Field(
        None, description="vime's whole eval-rollout function; refused: our eval runs vLLM in-process"
    )


class LoggingConfig(_Section):
    output_dir: str = Field("runs/latest", description="metrics.jsonl, tensorboard, eval results")
    use_tensorboard: bool = False
    # A resumed run (the same --save) continues the same W&B and MLflow runs: vime_engine/tracking/.
    use_wandb: bool = False
    wandb_project: str | None = Field(None, description="default: vimeflow")
    wandb_team: str | None = Field(None, description="W&B entity; default: the account's default entity")
    wandb_group: str | None = None
    wandb_run_id: str | None = Field(None, description="W&B run to create or continue; default: kept in --save")
    wandb_mode: Literal["online", "offline"] | None = Field(
        None, description="default: W&B's own setting (WANDB_MODE, `wandb offline`); offline needs no network"
    )
    wandb_dir: str | None = Field(None, description="where W&B keeps its files; default: --output-dir")
    use_mlflow: bool = False
    mlflow_tracking_uri: str | None = Field(
        None, description="default: $MLFLOW_TRACKING_URI, else sqlite:///<output-dir>/mlflow.db"
    )
    mlflow_experiment_name: str | None = Field(None, description="where a new run is created; default: vimeflow")
    mlflow_run_id: str | None = Field(None, description="an existing MLflow run to continue; default: kept in --save")
    custom_rollout_log_function_path: str | None = Field(
        None, description="`(rollout_id, args, samples, extra_metrics, rollout_time) -> bool`: True skips ours"
    )


# Megatron-Core flags: accepted so vime scripts carry over, handed to the Megatron backend untouched.
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
}
_PARALLEL_FLAGS = [f for f in MEGATRON_FLAGS if f.endswith("parallel-size")]

SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "data": DataConfig,
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "algorithm": AlgorithmConfig,
    "train": TrainConfig,
    "placement": PlacementConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "logging": LoggingConfig,
}

# Fields that do not change the trained weights: they may differ between a checkpoint and the run resuming it.
# Paths are among them: a resumed chunk may see the same model and data under other paths (another machine, a
# ModelArts container); content identity is the orchestrator's job (staged manifests in the chunk cache key),
# and the checkpoint itself refuses a dataset of another size or weights of another shape.
NON_MATH_FIELDS = {
    "hf_checkpoint", "ref_load", "prompt_data", "custom_rm_path", "rm_url", "dynamic_sampling_filter_path",
    "custom_generate_function_path",
    "buffer_filter_path", "rollout_sample_filter_path", "rollout_all_samples_process_path",
    "custom_reward_post_process_path", "custom_advantage_function_path", "rollout_function_path",
    "eval_function_path",
    "num_rollout", "start_rollout_id", "save", "save_interval", "load", "keep_last", "save_hf",
    *LoggingConfig.model_fields, "ray_address", "balance_data",
    "eval_prompt_data", "eval_interval", "n_samples_per_eval_prompt", "eval_max_response_len",
    "eval_temperature", "eval_top_p", "eval_input_key", "eval_label_key", "eval_rm_type",
    "vllm_gpu_memory_utilization", "vllm_kv_cache_gb", "rollout_num_gpus", "rollout_num_gpus_per_engine",
    "actor_num_nodes", "actor_num_gpus_per_node", "weight_sync", "weight_sync_bucket_mb",
    "use_fault_tolerance", "rollout_health_check_interval", "rollout_health_check_timeout",
    "rollout_health_check_first_wait", "rollout_max_engine_restarts",
    "vllm_enforce_eager", "vllm_enable_prefix_caching", "vllm_enable_chunked_prefill", "vllm_max_num_batched_tokens",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainConfig = TrainConfig()
    placement: PlacementConfig = PlacementConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    megatron: dict[str, Any] = Field(default_factory=dict, description="Megatron-Core flags, passed through")

    @model_validator(mode="after")
    def _check_combinations(self) -> EngineConfig:
        # Imported here: the checks read this module's types and errors, so it must be loaded first.
        from vime_engine.config_checks import check_combinations

        check_combinations(self)
        return self

    # -- derived values -------------------------------------------------------------------------------------
    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def global_batch_size(self) -> int:
        if self.train.global_batch_size is not None:
            return self.train.global_batch_size
        return self.samples_per_rollout // (self.train.num_steps_per_rollout or 1)

    @property
    def trainer_world_size(self) -> int:
        """Trainer ranks: `--actor-num-nodes × --actor-num-gpus-per-node`."""
        return self.placement.actor_num_nodes * self.placement.actor_num_gpus_per_node

    @property
    def rollout_engines(self) -> int:
        """vLLM engines of the rollout group: `--rollout-num-gpus / --rollout-num-gpus-per-engine` (one without
        `--rollout-num-gpus`)."""
        r = self.rollout
        return 1 if r.rollout_num_gpus is None else r.rollout_num_gpus // r.rollout_num_gpus_per_engine

    @property
    def model_parallel_size(self) -> int:
        """Tensor × pipeline × context parallel size (1 for the torch backend)."""
        m = self.megatron
        return (m.get("tensor-model-parallel-size") or 1) * (m.get("pipeline-model-parallel-size") or 1) * (
            m.get("context-parallel-size") or 1)

    @property
    def data_parallel_size(self) -> int:
        return self.trainer_world_size // self.model_parallel_size

    @property
    def eps_clip_high(self) -> float:
        return self.algorithm.eps_clip if self.algorithm.eps_clip_high is None else self.algorithm.eps_clip_high

    @property
    def eval_datasets(self) -> list[tuple[str, str]]:
        items = self.eval.eval_prompt_data or []
        return list(zip(items[0::2], items[1::2]))

    def flat(self) -> dict[str, Any]:
        """All fields by their flat (flag) names."""
        out: dict[str, Any] = {}
        for section in SECTIONS:
            out.update(getattr(self, section).model_dump())
        out.update({f"megatron.{k}": v for k, v in self.megatron.items()})
        return out

    def _non_math_fields(self) -> set[str]:
        # The run length sets the LR schedule's length unless the LR is constant or the decay length is given.
        if self.train.lr_decay_style != "constant" and self.train.lr_decay_iters is None:
            return NON_MATH_FIELDS - {"num_rollout"}
        return NON_MATH_FIELDS

    def math_fields(self) -> dict[str, Any]:
        """The fields that change the trained weights; a checkpoint resumes only under equal values."""
        skip = self._non_math_fields()
        return {k: v for k, v in self.flat().items() if k not in skip}

    def math_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.math_fields(), sort_keys=True, default=str).encode()).hexdigest()

    def math_diff(self, saved_math_fields: dict[str, Any]) -> list[str]:
        """`--flag: saved -> now` for every math field that differs from a checkpoint's `math_fields()`."""
        mine = json.loads(json.dumps(self.math_fields(), default=str))
        keys = set(mine) | set(saved_math_fields)
        return sorted(
            f"{_flag(k)}: {saved_math_fields.get(k)!r} -> {mine.get(k)!r}"
            for k in keys
            if mine.get(k) != saved_math_fields.get(k)
        )

    def with_overrides(self, **flat_values: Any) -> EngineConfig:
        """A copy with some flat fields replaced (validated)."""
        values = self.flat()
        values.update(flat_values)
        return from_flat(values)


# -- building from YAML and flags -------------------------------------------------------------------------------
_FIELD_SECTION: dict[str, str] = {
    name: section for section, model in SECTIONS.items() for name in model.model_fields
}


def from_flat(values: dict[str, Any]) -> EngineConfig:
    """Build from flat names (`rollout_batch_size` / `rollout-batch-size`); Megatron flags go to `megatron`."""
    nested: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    megatron: dict[str, Any] = {}
    unknown = []
    for raw_key, value in values.items():
        key = raw_key.replace("-", "_")
        if key.startswith("megatron."):
            name = key.removeprefix("megatron.").replace("_", "-")
            megatron[name] = _typed_megatron_value(name, value)
        elif key in _FIELD_SECTION:
            nested[_FIELD_SECTION[key]][key] = value
        elif key.replace("_", "-") in MEGATRON_FLAGS:
            megatron[key.replace("_", "-")] = _typed_megatron_value(key.replace("_", "-"), value)
        else:
            unknown.append(raw_key)
    if unknown:
        raise ConfigError(_unknown_message([_flag(k) for k in unknown]))
    try:
        return EngineConfig(**{s: v for s, v in nested.items() if v or s in ("model", "data")}, megatron=megatron)
    except ValidationError as exc:
        raise ConfigError(_validation_message(exc)) from None


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _typed_megatron_value(name: str, value: Any) -> Any:
    """A Megatron pass-through flag's value as its declared type (flags arrive as text: `--sequence-parallel=false`
    must be False, `--recompute-num-layers 4` the int 4)."""
    kind = MEGATRON_FLAGS.get(name)
    if kind is None or value is None:
        return value
    if kind is bool:
        text = str(value).strip().lower()
        if isinstance(value, bool) or text in _TRUE + _FALSE:
            return value if isinstance(value, bool) else text in _TRUE
        raise ConfigError(f"--{name} {value!r}: expected true or false")
    if kind is str:
        return str(value)
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value) if kind is float else int(str(value))
    except ValueError:
        raise ConfigError(f"--{name} {value!r}: expected {'an integer' if kind is int else 'a number'}") from None


def _validation_message(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        if err["type"] == "missing":
            missing = [loc[-1]] if len(loc) > 1 else [
                n for n, f in SECTIONS[loc[0]].model_fields.items() if f.is_required()
            ]
            lines.append(f"missing required {' and '.join(_flag(n) for n in missing)}")
            continue
        flag = _flag(loc[-1]) if len(loc) > 1 else "config"
        if err["type"] == "value_error":
            lines.append(str(err.get("ctx", {}).get("error", err["msg"])))
        else:
            lines.append(f"{flag} {err.get('input')!r}: {err['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _unknown_message(flags: list[str]) -> str:
    import difflib

    known = [_flag(n) for n in _FIELD_SECTION] + [f"--{f}" for f in MEGATRON_FLAGS]
    parts = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1)
        parts.append(f"unknown flag {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
    return "; ".join(parts)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last
    value silently, so a config edited in two places would train with whichever came later)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be repeated by design
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # the base constructor reports unhashable keys itself
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {first_line[key] + 1}); keep one of them",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The flat flag values of a YAML file; every problem is a ConfigError naming the file and, for syntax
    errors and duplicate keys, the line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file" + (" (it is a directory)" if path.is_dir() else ""))
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_yaml_error_message(path, exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, found {type(data).__name__}")
    not_names = [k for k in data if not isinstance(k, str)]
    if not_names:
        raise ConfigError(
            f"--config {path}: {not_names[0]!r} is not a flag name; keys are names like rollout-batch-size"
        )
    return data


def _yaml_error_message(path: Path, exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    where = f"--config {path}, line {mark.line + 1}, column {mark.column + 1}" if mark else f"--config {path}"
    problem = exc.problem or exc.context or "not valid YAML"
    if exc.problem and exc.context and exc.context_mark and exc.context_mark.line != mark.line:
        problem += f" ({exc.context} that starts on line {exc.context_mark.line + 1}: close it there)"
    lines = path.read_text(encoding="utf-8").splitlines()
    line = lines[mark.line] if mark and mark.line < len(lines) else ""
    hint = "; YAML indents with spaces, never tabs: replace the tab with spaces" if "\t" in line else ""
    return f"{where}: {problem}{hint}"


def parse_flags(argv: list[str]) -> dict[str, Any]:
    """vime-style flags → flat values. Booleans are bare switches (`--use-kl-loss`); lists take several values."""
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r}: flags look like --rollout-batch-size 16")
        name, _, inline = token[2:].partition("=")
        kind = _flag_kind(name)
        if kind is None:
            raise ConfigError(_unknown_message([token.split("=")[0]]))
        i += 1
        if kind is bool and not inline:
            # A bare switch is true; a switch that also takes auto reads a following word (`--x false`).
            takes_word = _takes_auto(name) and i < len(argv) and argv[i].lower() in _TRUE + _FALSE + ("auto",)
            values[name] = argv[i] if takes_word else True
            i += int(takes_word)
            continue
        args = [inline] if inline else []
        while not args or (kind is list and i < len(argv) and not argv[i].startswith("--")):
            if i >= len(argv) or argv[i].startswith("--"):
                if args:
                    break
                raise ConfigError(f"--{name} needs a value")
            args.append(argv[i])
            i += 1
        values[name] = args if kind is list else _coerce_scalar(args[0])
    return values


def _flag_kind(name: str) -> type | None:
    if name in MEGATRON_FLAGS:
        return MEGATRON_FLAGS[name]
    key = name.replace("-", "_")
    section = _FIELD_SECTION.get(key)
    if section is None:
        return None
    annotation = SECTIONS[section].model_fields[key].annotation
    if annotation is bool or _takes_auto(name):
        return bool
    if "list[" in str(annotation):  # list[str] | None
        return list
    return str


def _takes_auto(name: str) -> bool:
    """A switch that may also be "auto" (the device decides), e.g. --vllm-enforce-eager."""
    key = name.replace("-", "_")
    section = _FIELD_SECTION.get(key)
    return section is not None and SECTIONS[section].model_fields[key].annotation == bool | Literal["auto"]


def _coerce_scalar(text: str) -> Any:
    # pydantic converts "16" → 16 for int fields; "none" spelled out means unset.
    return None if text.lower() == "none" else text


def build_config(argv: list[str] | None = None, yaml_path: str | Path | None = None, **defaults: Any) -> EngineConfig:
    """defaults < YAML file < command-line flags."""
    values: dict[str, Any] = dict(defaults)
    if yaml_path is not None:
        values.update(load_yaml(yaml_path))
    values.update(parse_flags(argv or []))
    return from_flat(values)
