"""The sections of EngineConfig: one pydantic model per part of the engine that reads it.

A field's name is its flag (`rollout_batch_size` is `--rollout-batch-size`); names are unique across sections. A
field that does not change the trained weights says so where it is declared (`non_math`); NON_MATH_FIELDS collects
them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticUndefined

from vime_engine.algorithms.estimators import ESTIMATORS
from vime_engine.config.errors import flag_name
from vime_engine.config.switches import switch_value


# The schema mark of a field, or of a whole section, that does not change the trained weights.
NON_MATH = {"math": False}


def non_math(default: Any = PydanticUndefined, **kwargs: Any) -> Any:
    """A Field that does not change the trained weights: a checkpoint and the run resuming it may differ in it
    (EngineConfig.math_fields, vime_engine/config/engine_config.py).

    Paths are such fields: a resumed chunk may see the same model and data under other paths (another machine, a
    ModelArts container); content identity is the orchestrator's job (staged manifests in the chunk cache key), and
    the checkpoint itself refuses a dataset of another size or weights of another shape.
    """
    return Field(default, json_schema_extra=NON_MATH, **kwargs)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    hf_checkpoint: str = non_math(description="HF model directory (local path) to start from")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="training and rollout dtype")


class DataConfig(_Section):
    prompt_data: str = non_math(description="prompt dataset, .jsonl or .parquet")
    input_key: str = Field("prompt", description="the row's key holding the prompt")
    label_key: str = Field("label", description="the row's key holding the label the reward grades against")
    metadata_key: str | None = Field(
        None, description="the row's key holding metadata for rewards and plugins (sample.metadata)"
    )
    apply_chat_template: bool = Field(False, description="render prompts with the tokenizer's chat template")
    rollout_shuffle: bool = Field(False, description="shuffle the prompts every epoch")
    rollout_seed: int = Field(42, description="seed of the prompt shuffle and of every group's sampling")
    rollout_max_prompt_len: int | None = Field(
        None, ge=1, description="drop prompts longer than this many tokens (chat template applied), train and eval"
    )


class RolloutConfig(_Section):
    num_rollout: int = non_math(1, ge=0, description="number of rollout → train iterations; 0 = eval only")
    rollout_batch_size: int = Field(8, ge=1, description="prompts per rollout")
    n_samples_per_prompt: int = Field(4, ge=1, description="responses sampled per prompt (one group)")
    rollout_max_response_len: int = Field(64, ge=1, description="the most tokens a response may hold")
    rollout_temperature: float = Field(1.0, gt=0, description="sampling temperature")
    rollout_top_p: float = Field(
        1.0, gt=0, le=1, description="nucleus sampling: the most likely tokens holding this much probability"
    )
    rollout_top_k: int = Field(-1, description="-1 disables top-k")
    over_sampling_batch_size: int | None = Field(None, ge=1, description="prompts generated per draw when filtering")
    dynamic_sampling_filter_path: str | None = non_math(
        None, description="keep a group? `(args, samples) -> bool | DynamicFilterOutput` (vime) or `(group) -> bool`"
    )
    # vime's rollout hooks (module:function or file.py:function; vime_engine/rollout/vime_hooks.py calls them).
    buffer_filter_path: str | None = non_math(
        None, description="`(args, rollout_id, buffer, num_samples) -> groups`: which cut-off groups resume first"
    )
    rollout_sample_filter_path: str | None = non_math(
        None, description="`(args, groups) -> None`: sets sample.remove_sample to keep a sample out of the loss"
    )
    rollout_all_samples_process_path: str | None = non_math(
        None, description="`(args, all_groups, data_source) -> None`: sees every group, filtered ones too"
    )
    rollout_function_path: str | None = non_math(
        None, description="vime's whole-rollout function; refused: our rollout runs vLLM in-process"
    )
    partial_rollout: bool = Field(
        False, description="stop generating once the batch is full; unfinished groups continue next rollout"
    )
    custom_generate_function_path: str | None = non_math(
        None, description="vime's `async (args, sample, sampling_params) -> Sample` generating each sample "
        "(multi-turn, tools) on the engine through args.rollout_engine; see vime_engine/rollout/custom_generate.py"
    )
    rollout_max_turns: int | None = Field(None, ge=1, description="the model's turns a multi-turn sample may hold")
    rollout_max_context_len: int | None = Field(
        None, ge=2, description="tokens a multi-turn sample may hold: prompt, every turn and every tool reply"
    )
    rollout_num_gpus: int | None = non_math(
        None, description="devices of the rollout engines when not colocated; default: one engine"
    )
    rollout_num_gpus_per_engine: int = non_math(1, description="devices per vLLM engine (tensor parallel inside it)")
    # slime's names: watch the disaggregated engines, restart a dead one and re-generate its groups.
    use_fault_tolerance: bool = non_math(
        False, description="restart a rollout engine that dies or stops answering, reload the current weights "
        "into it and generate its unfinished groups again (the same seeds: the same samples)"
    )
    rollout_health_check_interval: float = non_math(30.0, gt=0, description="seconds between engine health checks")
    rollout_health_check_timeout: float = non_math(
        30.0, gt=0, description="seconds an engine may take to answer a health check before it is restarted"
    )
    rollout_health_check_first_wait: float = non_math(
        0.0, ge=0, description="seconds after an engine (re)starts before its health checks begin"
    )
    rollout_max_engine_restarts: int = non_math(
        3, ge=0, description="engine restarts a run may make; one more death ends it with the retryable exit code"
    )
    vllm_gpu_memory_utilization: float = non_math(
        0.6, gt=0, le=1, description="share of an accelerator's memory vLLM may take"
    )
    vllm_max_model_len: int | None = Field(None, description="vLLM's context length; default: the model's")
    vllm_kv_cache_gb: float = non_math(1.0, gt=0, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)")
    # "auto" = the device's best (vime_engine/rollout/vllm_engine.py: device_engine_kwargs); a value given wins.
    vllm_enforce_eager: bool | Literal["auto"] = non_math(
        "auto", description="run vLLM without CUDA / ACL graphs; auto: eager on CPU, graphs on accelerators. "
        "true on an accelerator costs decode speed; false on CPU compiles the model first (a slow start)"
    )
    vllm_enable_prefix_caching: bool | Literal["auto"] = non_math(
        "auto", description="share the KV blocks of a prompt's n samples; auto: off on CPU, on on accelerators. "
        "true on CPU makes samples depend on the cache (log-probs up to 3e-5 apart from it off); false on an "
        "accelerator costs one prefill per sample instead of per prompt"
    )
    vllm_enable_chunked_prefill: bool | Literal["auto"] = non_math(
        "auto", description="split long prompts across engine steps; auto: off on CPU (whole prompts keep a "
        "sample's draws independent of the batch; CPU cannot run it with seeded sampling), on on accelerators. "
        "false on an accelerator costs throughput and needs --vllm-max-num-batched-tokens >= the model length"
    )
    vllm_max_num_batched_tokens: int | Literal["auto"] = non_math(
        "auto", description="tokens per engine step; auto: max(model length, 16384) without chunked prefill, "
        "vLLM's own budget with it"
    )
    vllm_max_num_seqs: int | None = non_math(None, ge=1, description="requests an engine step may hold; "
                                             "default: vLLM's")
    vllm_cudagraph_capture_sizes: list[int] | None = non_math(
        None, description="batch sizes vLLM captures CUDA / ACL graphs for; refused where the engine runs eagerly "
        "(CPU, --vllm-enforce-eager)"
    )
    vllm_attention_backend: str | None = non_math(
        None, description="vLLM's attention backend (FLASH_ATTN, FLASHINFER, ...); default: vLLM's choice. On CPU "
        "only CPU_ATTN runs"
    )
    vllm_enable_sleep_mode: bool = non_math(
        False, description="vLLM's sleep mode, with which a colocated engine hands its memory to the trainer: on "
        "already wherever that happens (colocated on an accelerator); refused elsewhere, where nothing sleeps"
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
        switch = switch_value(value)
        if switch is None:
            raise ValueError(f"{flag_name(info.field_name)} {value!r}: expected true, false or auto")
        return switch


class RewardConfig(_Section):
    rm_type: str = Field("math", description="math | gsm8k | dapo | deepscaler | code | remote_rm")
    custom_rm_path: str | None = non_math(None, description="module:function or file.py:function")
    rm_url: str | None = non_math(None, description="reward server for remote_rm (--rm-type or --eval-rm-type)")
    group_rm: bool = Field(False, description="call --custom-rm-path once per group: `async (args, samples)`")
    custom_reward_post_process_path: str | None = non_math(
        None, description="`(args, samples) -> (raw_rewards, rewards)`: replaces the group normalisation"
    )


KLType = Literal["k1", "k2", "k3", "low_var_kl"]


class AlgorithmConfig(_Section):
    advantage_estimator: str = Field(
        "grpo", description=f"{' | '.join(ESTIMATORS)} (the table: vime_engine/algorithms/estimators.py)"
    )
    use_kl_loss: bool = Field(False, description="add a KL term against the reference model to the loss")
    kl_loss_coef: float = Field(0.0, description="weight of the KL loss (--use-kl-loss)")
    kl_loss_type: KLType = Field("low_var_kl", description="estimator of the KL loss: k1, k2, k3 or low_var_kl")
    kl_coef: float = Field(0.0, description="KL penalty folded into the reward (estimators with uses_reward_kl)")
    entropy_coef: float = Field(0.0, description="weight of the entropy bonus in the loss")
    moe_aux_loss_coeff: float = Field(
        0.0, ge=0, description="weight of a mixture-of-experts model's router load-balancing loss (Megatron's "
        "aux_loss, HF's aux_loss on the torch backends); 0: not computed"
    )
    use_routing_replay: bool = Field(
        False, description="mixture of experts: the training forwards send each token to the experts the rollout's "
        "old-policy forward chose (routing replay, arXiv 2507.18071)"
    )
    use_rollout_routing_replay: bool = Field(
        False, description="mixture of experts: every forward of the policy sends each token to the experts the "
        "rollout engine chose while generating it (R3, arXiv 2510.11370; implies --use-routing-replay)"
    )
    eps_clip: float = Field(
        0.2, ge=0, description="PPO clip range below the ratio 1 (and above it, without --eps-clip-high)"
    )
    eps_clip_high: float | None = Field(None, ge=0, description="defaults to --eps-clip")
    eps_clip_c: float | None = Field(None, gt=1, description="dual-clip constant (> 1)")
    normalize_advantages: bool = Field(False, description="whiten the advantages over the rollout's trained tokens")
    disable_grpo_std_normalization: bool = Field(
        False, description="centre a group's rewards without dividing by their std"
    )
    use_tis: bool = Field(
        False, description="truncated importance sampling: weight the loss by the train / rollout probability ratio"
    )
    tis_clip: float = Field(2.0, gt=0, description="upper clip of the TIS weight")
    calculate_per_token_loss: bool = Field(
        False, description="average the loss over the batch's tokens instead of over its samples"
    )
    gamma: float = Field(1.0, ge=0, le=1, description="discount factor (ppo, reinforce_plus_plus)")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda (ppo)")
    value_clip: float = Field(0.2, gt=0, description="clip range of the critic's value loss (ppo)")
    custom_advantage_function_path: str | None = non_math(
        None, description="`(args, rollout_data) -> None`: sets rollout_data['advantages'] and ['returns']"
    )

    @field_validator("advantage_estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        """Any name of the estimators' table: an estimator added there needs no edit here."""
        if value not in ESTIMATORS:
            raise ValueError(f"--advantage-estimator {value!r}: expected one of {', '.join(ESTIMATORS)}")
        return value

    @property
    def routing_replay(self) -> Literal["rollout", "old_policy"] | None:
        """Which routing the policy's forwards replay: the engine's (R3), the rollout's old-policy forward's (R2), or
        none (the routers choose)."""
        if self.use_rollout_routing_replay:
            return "rollout"
        return "old_policy" if self.use_routing_replay else None

    @property
    def routing_replay_flag(self) -> str | None:
        """The flag that asked for `routing_replay`, for messages."""
        return {"rollout": "--use-rollout-routing-replay", "old_policy": "--use-routing-replay"}.get(
            self.routing_replay)


class TrainConfig(_Section):
    train_backend: Literal["torch", "fsdp", "megatron"] = Field(
        "torch", description="torch: an HF model, data parallel by DDP; fsdp: the same with parameters, gradients "
        "and optimizer state sharded over the ranks (FSDP2); megatron: Megatron-Core, with tensor, pipeline, "
        "expert and data parallelism")
    megatron_to_hf_mode: Literal["raw", "bridge"] = non_math(
        "raw", description="megatron: how weights cross between HF and Megatron (initial load, weight sync, "
        "--save-hf, vimeflow convert): raw, the engine's own mapping; bridge, Megatron-Bridge's AutoBridge (Python "
        ">= 3.12; the same tensors)")
    global_batch_size: int | None = Field(None, ge=1, description="samples per optimizer step")
    num_steps_per_rollout: int | None = Field(
        None, ge=1, description="optimizer steps per rollout; default: the rollout's samples / --global-batch-size"
    )
    use_dynamic_batch_size: bool = Field(
        False, description="micro-batches by token budget (--max-tokens-per-gpu) even with --micro-batch-size"
    )
    max_tokens_per_gpu: int | None = Field(
        None, ge=1, description="padded tokens per micro-batch; default: from the model and a quarter of device memory"
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="samples per micro-batch; unset: micro-batches by token budget (--max-tokens-per-gpu)")
    balance_data: bool = non_math(
        False, description="even out tokens across data-parallel ranks in each optimizer step")
    optimizer: Literal["adam"] = Field("adam", description="the optimizer (Adam with decoupled weight decay)")
    lr: float = Field(1e-6, gt=0, description="learning rate")
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="constant, or linear / cosine decay to --min-lr"
    )
    lr_warmup_iters: int = Field(0, ge=0, description="optimizer steps of linear warmup")
    lr_decay_iters: int | None = Field(None, ge=1, description="optimizer steps of the decay; default: the whole run")
    min_lr: float = Field(0.0, ge=0, description="the learning rate the decay ends at")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    adam_beta1: float = Field(0.9, description="Adam's beta1")
    adam_beta2: float = Field(0.999, description="Adam's beta2")
    adam_eps: float = Field(1e-8, description="Adam's epsilon")
    clip_grad: float = Field(1.0, ge=0, description="0 disables gradient clipping")
    seed: int = Field(1234, description="the trainer's torch seed")


class PlacementConfig(_Section):
    colocate: bool | Literal["auto"] = non_math(
        "auto", description="trainer rank i and engine i share one actor (and device); auto: on a CPU run of one "
        "node with the torch backend, unless a flag needs the engine on its own actor"
    )
    async_rollout: bool = Field(False, description="generate rollout i+1 while training on i (not colocated)")
    actor_num_nodes: int = non_math(1, ge=1, description="nodes of the trainer group")
    actor_num_gpus_per_node: int = non_math(1, ge=1, description="trainer ranks (devices) per node")
    ray_address: str | None = non_math(None, description="Ray cluster address; default: a private local cluster")
    device: Literal["auto", "cpu", "cuda", "npu"] = Field(
        "auto", description="cpu, cuda or npu; auto: what the machine has"
    )
    weight_sync: Literal["object_store", "broadcast"] = non_math(
        "object_store", description="disaggregated weight sync: Ray's object store or a bucketed collective broadcast"
    )
    weight_sync_bucket_mb: float = non_math(64, gt=0, description="bucket size of the broadcast weight sync (MiB)")
    rollout_mode: Literal["auto", "inprocess", "server"] = non_math(
        "auto", description="the rollout engines as vLLM in the engine's actor (inprocess) or as `vllm serve` "
        "servers behind vllm-router (server, vime's layout: plugins and outside agents reach the policy over HTTP); "
        "auto: inprocess"
    )
    vllm_router_ip: str | None = non_math(
        None, description="server mode: an existing vllm-router to register the servers with; default: start one"
    )
    vllm_router_port: int | None = non_math(None, ge=1, le=65535, description="the port of --vllm-router-ip")
    vllm_router_request_timeout_secs: int = non_math(
        14400, ge=1, description="server mode: seconds a generate request may take through the router"
    )
    router_policy: Literal[
        "random", "round_robin", "cache_aware", "kv_aware", "power_of_two", "consistent_hash", "sticky_least_loaded"
    ] = non_math("consistent_hash", description="server mode: how the router picks a server for each request "
                 "(consistent_hash keeps a group's samples, one x-session-id, on one server)")
    train_memory_margin_bytes: int = non_math(
        0, ge=0, description="colocated on an accelerator: device memory that must stay free once the trainer has "
        "taken the memory back from the engine (vime's TorchMemorySaver margin); 0 on CPU"
    )
    no_offload_train: bool = non_math(
        False, description="colocated on an accelerator: the trainer's weights, gradients and optimizer state stay "
        "on the device while the engine generates (vime's flag; the torch backends otherwise move them to host)"
    )


class CheckpointConfig(_Section):
    save: str | None = non_math(None, description="checkpoint directory")
    save_interval: int | None = non_math(None, ge=1, description="save every N rollouts (and after the last)")
    load: str | None = non_math(
        None, description="resume from the newest valid checkpoint in this directory; default: --save"
    )
    ref_load: str | None = non_math(None, description="reference model for the KL term (default: --hf-checkpoint)")
    start_rollout_id: int | None = non_math(
        None, ge=0, description="the first rollout id; default: the loaded checkpoint's next, else 0"
    )
    keep_last: int | None = non_math(None, ge=1, description="keep only the newest N checkpoints")
    save_hf: str | None = non_math(None, description="export the final weights as an HF directory")


class EvalConfig(_Section):
    eval_prompt_data: list[str] | None = non_math(None, description="NAME PATH [NAME PATH ...]")
    eval_interval: int | None = non_math(None, ge=1, description="evaluate every N rollouts (and after the last)")
    n_samples_per_eval_prompt: int = non_math(1, ge=1, description="responses per eval problem (avg@n, pass@k)")
    eval_max_response_len: int | None = non_math(None, description="default: --rollout-max-response-len")
    eval_temperature: float | None = non_math(None, description="default: --rollout-temperature")
    eval_top_p: float | None = non_math(None, description="default: --rollout-top-p")
    eval_top_k: int | None = non_math(None, description="default: --rollout-top-k (-1 disables top-k)")
    eval_input_key: str | None = non_math(None, description="default: --input-key")
    eval_label_key: str | None = non_math(None, description="default: --label-key")
    eval_rm_type: str | None = non_math(None, description="default: --rm-type")
    eval_function_path: str | None = non_math(
        None, description="vime's whole eval-rollout function; refused: our eval runs vLLM in-process"
    )


class LoggingConfig(_Section):
    model_config = ConfigDict(json_schema_extra=NON_MATH)  # what is logged where never changes the weights
    output_dir: str = Field("runs/latest", description="metrics.jsonl, tensorboard, eval results")
    use_tensorboard: bool = Field(False, description="write TensorBoard events under --output-dir")
    # A resumed run (the same --save) continues the same W&B and MLflow runs: vime_engine/tracking/.
    use_wandb: bool = Field(False, description="log to Weights & Biases")
    wandb_project: str | None = Field(None, description="default: vimeflow")
    wandb_team: str | None = Field(None, description="W&B entity; default: the account's default entity")
    wandb_group: str | None = Field(None, description="the W&B group of the run")
    wandb_run_id: str | None = Field(None, description="W&B run to create or continue; default: kept in --save")
    wandb_mode: Literal["online", "offline"] | None = Field(
        None, description="default: W&B's own setting (WANDB_MODE, `wandb offline`); offline needs no network"
    )
    wandb_dir: str | None = Field(None, description="where W&B keeps its files; default: --output-dir")
    wandb_host: str | None = Field(None, description="the W&B server's URL; default: W&B's own (WANDB_BASE_URL)")
    use_mlflow: bool = Field(False, description="log to MLflow")
    mlflow_tracking_uri: str | None = Field(
        None, description="default: $MLFLOW_TRACKING_URI, else sqlite:///<output-dir>/mlflow.db"
    )
    mlflow_experiment_name: str | None = Field(None, description="where a new run is created; default: vimeflow")
    mlflow_run_id: str | None = Field(None, description="an existing MLflow run to continue; default: kept in --save")
    custom_rollout_log_function_path: str | None = Field(
        None, description="`(rollout_id, args, samples, extra_metrics, rollout_time) -> bool`: True skips ours"
    )

    @property
    def log_dir(self) -> Path:
        """The run's logs: `vimeflow train`'s engine.log, each `vllm serve` engine's and the router's."""
        return Path(self.output_dir) / "logs"


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

# A field's section, by the field's (flat) name; names are unique across sections.
FIELD_SECTION: dict[str, str] = {
    name: section for section, model in SECTIONS.items() for name in model.model_fields
}


def _is_non_math(schema_extra: Any) -> bool:
    return isinstance(schema_extra, dict) and schema_extra.get("math") is False


# The fields that do not change the trained weights: they may differ between a checkpoint and the run resuming it.
NON_MATH_FIELDS: frozenset[str] = frozenset(
    name for model in SECTIONS.values() for name, field in model.model_fields.items()
    if _is_non_math(model.model_config.get("json_schema_extra")) or _is_non_math(field.json_schema_extra)
)
