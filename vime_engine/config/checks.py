"""Rules between EngineConfig's flags, checked once when a configuration is built (vime_engine.config).

Each rule that fails raises ConfigError with a message naming the flags involved and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vime_engine.algorithms.estimators import ESTIMATORS
from vime_engine.config.errors import ConfigError, flag_name
from vime_engine.config.megatron_flags import PARALLEL_FLAGS
from vime_engine.config.sections import AlgorithmConfig, LoggingConfig

if TYPE_CHECKING:  # the rules run inside EngineConfig's validator
    from vime_engine.config.engine_config import EngineConfig


def check_combinations(cfg: EngineConfig) -> None:
    """Every rule between flags; the first one broken raises ConfigError naming the flags and the fix."""
    r, t, a = cfg.rollout, cfg.train, cfg.algorithm
    per_rollout = cfg.samples_per_rollout
    if t.global_batch_size is not None and t.num_steps_per_rollout is not None:
        if t.global_batch_size * t.num_steps_per_rollout != per_rollout:
            raise ConfigError(
                f"--global-batch-size {t.global_batch_size} × --num-steps-per-rollout {t.num_steps_per_rollout} "
                f"must equal --rollout-batch-size × --n-samples-per-prompt = {per_rollout}; give only one of them"
            )
    gbs = cfg.global_batch_size
    if gbs == 0 or per_rollout % gbs:
        divisors = [d for d in range(1, per_rollout + 1) if per_rollout % d == 0]
        raise ConfigError(
            f"--global-batch-size {gbs} does not divide --rollout-batch-size × --n-samples-per-prompt = "
            f"{r.rollout_batch_size} × {r.n_samples_per_prompt} = {per_rollout}; use one of {divisors}"
        )
    if ESTIMATORS[a.advantage_estimator].group_baseline and r.n_samples_per_prompt < 2:
        raise ConfigError(
            f"--advantage-estimator {a.advantage_estimator} compares samples of one prompt: "
            "set --n-samples-per-prompt to 2 or more"
        )
    _check_kl_flags(a)
    if cfg.placement.async_rollout and cfg.placement.colocate is True:
        raise ConfigError("--async-rollout needs the rollout engine on its own actor: drop --colocate")
    _check_fault_tolerance(cfg)
    _check_server_mode(cfg)
    _check_rollout_routing_replay(cfg)
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.rollout_batch_size:
        raise ConfigError(
            f"--over-sampling-batch-size {r.over_sampling_batch_size} must be >= --rollout-batch-size "
            f"{r.rollout_batch_size}"
        )
    if r.partial_rollout and (r.over_sampling_batch_size or 0) <= r.rollout_batch_size:
        raise ConfigError(
            "--partial-rollout cuts off the groups still generating once --rollout-batch-size groups are done, "
            "so it needs more in flight: set --over-sampling-batch-size larger than --rollout-batch-size "
            f"{r.rollout_batch_size}"
        )
    if r.partial_rollout and cfg.placement.async_rollout:
        raise ConfigError(
            "--partial-rollout watches each round from the driver to cut it off when the batch is full, while "
            "--async-rollout generates the next rollout unwatched during training: use one of them"
        )
    _check_lengths_within_model_len(cfg)
    if len(cfg.eval.eval_prompt_data or []) % 2:
        raise ConfigError("--eval-prompt-data takes pairs: NAME PATH [NAME PATH ...]")
    if cfg.eval.eval_interval is not None and not cfg.eval.eval_prompt_data:
        raise ConfigError("--eval-interval needs --eval-prompt-data NAME PATH")
    _check_rm_url(cfg)
    _check_vime_hooks(cfg)
    _check_multi_turn_caps(cfg)
    _check_tracking(cfg.logging)
    if cfg.checkpoint.save_interval is not None and cfg.checkpoint.save is None:
        raise ConfigError("--save-interval needs --save DIR")
    if t.megatron_to_hf_mode != "raw" and t.train_backend != "megatron":
        raise ConfigError(f"--megatron-to-hf-mode {t.megatron_to_hf_mode} converts a Megatron model's weights; the "
                          f"{t.train_backend} backend trains the HF model itself: drop the flag or use "
                          "--train-backend megatron")
    _check_parallel_layout(cfg)


def _check_parallel_layout(cfg: EngineConfig) -> None:
    """The trainer ranks must split into the model-parallel layout and the data-parallel ranks into the batch."""
    p, t = cfg.placement, cfg.train
    world = cfg.trainer_world_size
    ranks = f"--actor-num-nodes {p.actor_num_nodes} × --actor-num-gpus-per-node {p.actor_num_gpus_per_node} = {world}"
    if t.train_backend != "megatron":
        parallel = [f"--{f} {cfg.megatron[f]}" for f in PARALLEL_FLAGS if cfg.megatron.get(f, 1) not in (1, None)]
        if parallel:
            raise ConfigError(f"{', '.join(parallel)} need --train-backend megatron (the {t.train_backend} backend "
                              "is data parallel only)")
    _check_expert_parallel_layout(cfg, world, ranks)
    model_parallel = cfg.model_parallel_size
    if world % model_parallel:
        raise ConfigError(
            f"{ranks} trainer ranks do not split into tensor × pipeline × context parallel groups of "
            f"{model_parallel}: make the rank count a multiple of {model_parallel}"
        )
    dp = world // model_parallel
    if cfg.global_batch_size % dp:
        raise ConfigError(
            f"--global-batch-size {cfg.global_batch_size} does not split over {dp} data-parallel ranks ({ranks} "
            f"trainer ranks / model-parallel size {model_parallel}): use a multiple of {dp}"
        )
    _check_rollout_layout(cfg)


def _check_expert_parallel_layout(cfg: EngineConfig, world: int, ranks: str) -> None:
    """Megatron's MoE layers split the ranks by expert tensor × expert × pipeline parallelism (the rest replicate
    the experts), and reduce an expert's gradients apart from the dense ones only under expert parallelism."""
    m = cfg.megatron
    tensor, pipeline = m.get("tensor-model-parallel-size") or 1, m.get("pipeline-model-parallel-size") or 1
    expert, expert_tensor = m.get("expert-model-parallel-size") or 1, m.get("expert-tensor-parallel-size") or tensor
    if world % (expert * expert_tensor * pipeline):
        raise ConfigError(
            f"{ranks} trainer ranks do not split into expert tensor × expert × pipeline parallel groups of "
            f"{expert_tensor} × {expert} × {pipeline}: make the rank count a multiple of "
            f"{expert * expert_tensor * pipeline}")
    if expert == 1 and expert_tensor != tensor:
        raise ConfigError(
            f"--expert-tensor-parallel-size {expert_tensor} with --tensor-model-parallel-size {tensor} needs "
            "--expert-model-parallel-size > 1: without expert parallelism Megatron reduces the experts' gradients "
            "over the data-parallel ranks like the dense ones', which would sum different shards; give the same "
            "size or add expert parallelism")


def _check_rollout_layout(cfg: EngineConfig) -> None:
    """The rollout devices must split into whole engines; colocated runs have one engine beside each rank."""
    r = cfg.rollout
    per_engine = r.rollout_num_gpus_per_engine
    if per_engine < 1:
        raise ConfigError(f"--rollout-num-gpus-per-engine {per_engine}: an engine needs at least 1 device")
    if cfg.placement.colocate is True:
        _check_colocated_engines(cfg)
        return
    if r.rollout_num_gpus is not None and (r.rollout_num_gpus < per_engine or r.rollout_num_gpus % per_engine):
        raise ConfigError(
            f"--rollout-num-gpus {r.rollout_num_gpus} does not split into engines of --rollout-num-gpus-per-engine "
            f"{per_engine}: use a multiple of {per_engine}"
        )


def _check_colocated_engines(cfg: EngineConfig) -> None:
    """Colocated: engine i runs inside trainer rank i's actor, on that rank's one device, or with E devices per
    engine as one tensor-parallel engine across ranks iE … iE+E−1, which must be on one node."""
    r, world, per_node = cfg.rollout, cfg.trainer_world_size, cfg.placement.actor_num_gpus_per_node
    per_engine = r.rollout_num_gpus_per_engine
    if per_node % per_engine:
        raise ConfigError(
            f"--colocate spreads each engine over --rollout-num-gpus-per-engine {per_engine} trainer ranks of one "
            f"node, but --actor-num-gpus-per-node {per_node} does not split into engines of {per_engine}: use a "
            f"divisor of {per_node}"
        )
    if r.rollout_num_gpus not in (None, world):
        raise ConfigError(
            f"--colocate runs the engines on the devices of the {world} trainer ranks, but "
            f"--rollout-num-gpus {r.rollout_num_gpus} asks for {r.rollout_num_gpus}: leave it out or give {world}"
        )


def _check_fault_tolerance(cfg: EngineConfig) -> None:
    """What a restarted engine can rejoin: an own actor, the object-store sync, whole (not streamed) rollouts."""
    p = cfg.placement
    if not cfg.rollout.use_fault_tolerance:
        return
    why = None
    if p.colocate is True:
        why = "--colocate puts the engine inside the trainer's actor, which a restart would lose: drop --colocate"
    elif p.weight_sync == "broadcast":
        why = ("a restarted engine cannot join the running broadcast group (--weight-sync broadcast): "
               "use --weight-sync object_store")
    elif p.async_rollout:
        why = ("a rollout prefetched under --async-rollout was started on weights the trainer has moved past, "
               "so an engine restarted during it could not re-generate it: drop --async-rollout")
    elif cfg.rollout.partial_rollout:
        why = ("a --partial-rollout round is streamed group by group, which engine restarts do not re-run yet: "
               "drop --partial-rollout")
    if why:
        raise ConfigError(f"--use-fault-tolerance: {why}")


def _check_server_mode(cfg: EngineConfig) -> None:
    """What `--rollout-mode server` runs: whole rounds on servers of their own, synced through the object store."""
    p, r = cfg.placement, cfg.rollout
    if (p.vllm_router_ip is None) != (p.vllm_router_port is None):
        raise ConfigError("--vllm-router-ip and --vllm-router-port name an existing router together: give both, "
                          "or neither to start one")
    if p.rollout_mode != "server":
        if p.vllm_router_ip is not None:
            raise ConfigError("--vllm-router-ip registers server engines with a router: add --rollout-mode server")
        return
    why = None
    if p.colocate is True:
        why = "each engine is a server of its own, beside the trainer: drop --colocate"
    elif p.weight_sync == "broadcast":
        why = ("the servers load weights through their control endpoints (--weight-sync object_store); the "
               "collective broadcast into a server is not built yet")
    elif r.partial_rollout or r.over_sampling_batch_size is not None or r.dynamic_sampling_filter_path:
        # A streamed round keeps the groups that finish first; over HTTP which those are depends on timing.
        why = ("a streamed round (--partial-rollout, --over-sampling-batch-size, --dynamic-sampling-filter-path) "
               "keeps the groups that finish first, which over HTTP depends on timing: not built yet in server mode")
    if why:
        raise ConfigError(f"--rollout-mode server: {why}")


def _check_rollout_routing_replay(cfg: EngineConfig) -> None:
    """Where the engine's routed experts can come back with each sample (the platform is checked by the
    preflight, which knows the device)."""
    r = cfg.rollout
    if not cfg.algorithm.use_rollout_routing_replay:
        return
    why = None
    if cfg.placement.rollout_mode == "server":
        why = ("the routed experts in the servers' /inference/v1/generate answers are not read yet: use "
               "--rollout-mode inprocess")
    elif r.custom_generate_function_path:
        why = ("a --custom-generate-function-path function's turns do not carry their routed experts yet: drop "
               "one of the two")
    elif r.vllm_enable_prefix_caching is False:
        why = "vLLM returns routed experts only with its prefix cache on: drop --vllm-enable-prefix-caching false"
    if why:
        raise ConfigError(f"--use-rollout-routing-replay: {why}")


# vime's own whole-rollout functions; naming one of them asks for what our engine does anyway.
VIME_ROLLOUT_FUNCTIONS = (
    "slime.rollout.sglang_rollout.generate_rollout", "slime.rollout.vllm_rollout.generate_rollout",
)


def _check_vime_hooks(cfg: EngineConfig) -> None:
    """vime's hooks that cannot act here are refused, each with the reason (the others:
    vime_engine/rollout/vime_hooks.py, vime_engine/train/vime_hooks.py)."""
    for flag, value in (("--rollout-function-path", cfg.rollout.rollout_function_path),
                        ("--eval-function-path", cfg.eval.eval_function_path)):
        if value is not None and value not in VIME_ROLLOUT_FUNCTIONS:
            raise ConfigError(
                f"{flag} {value}: vime's rollout functions drive its SGLang / vLLM servers over HTTP through its "
                "router and data source, which this engine does not run (vLLM runs in-process here). Keep the "
                "default rollout and move per-sample logic to --custom-generate-function-path / --custom-rm-path"
            )
    if cfg.reward.group_rm and not cfg.reward.custom_rm_path:
        raise ConfigError(
            "--group-rm calls --custom-rm-path once per group; the built-in rewards already grade a group at "
            "once: give --custom-rm-path FILE.py:FUNCTION written as `async (args, samples) -> list[float]`"
        )
    if cfg.rollout.buffer_filter_path and not cfg.rollout.partial_rollout:
        raise ConfigError(
            "--buffer-filter-path picks which cut-off groups resume, and groups are cut off only with "
            "--partial-rollout: add it (with --over-sampling-batch-size), or drop --buffer-filter-path"
        )


def _check_tracking(lg: LoggingConfig) -> None:
    for tracker, used in (("wandb", lg.use_wandb), ("mlflow", lg.use_mlflow)):
        unused = [flag_name(k) for k, v in lg if k.startswith(f"{tracker}_") and v is not None and not used]
        if unused:
            raise ConfigError(f"{', '.join(unused)} take effect only with --use-{tracker}: add it, or drop them")
    if lg.mlflow_run_id is not None and lg.mlflow_experiment_name is not None:
        raise ConfigError(
            "--mlflow-experiment-name names where a new run is created, but --mlflow-run-id continues a run that "
            "has its experiment already: give one of them"
        )


def _check_rm_url(cfg: EngineConfig) -> None:
    # A custom reward takes precedence over --rm-type (as in vime), so then only --eval-rm-type can use the URL.
    train_remote = cfg.reward.rm_type == "remote_rm" and cfg.reward.custom_rm_path is None
    remote = train_remote or cfg.eval.eval_rm_type == "remote_rm"
    url = cfg.reward.rm_url
    if remote and not url:
        raise ConfigError("--rm-type remote_rm (or --eval-rm-type remote_rm) needs --rm-url http://HOST:PORT/")
    if url and not remote:
        raise ConfigError(
            f"--rm-url {url} is only read by remote_rm: set --rm-type remote_rm (without --custom-rm-path) or "
            "--eval-rm-type remote_rm, or drop --rm-url"
        )
    if url and not url.startswith(("http://", "https://")):
        raise ConfigError(f"--rm-url {url!r}: expected an http:// or https:// URL, e.g. http://127.0.0.1:8000/")


def _check_lengths_within_model_len(cfg: EngineConfig) -> None:
    """The response budgets (training and eval) leave room for a prompt within --vllm-max-model-len, and a
    multi-turn sample's cap fits in it (against the model's own context: preflight._check_context_limits)."""
    r = cfg.rollout
    if r.vllm_max_model_len is None:
        return
    for flag, value in (("--rollout-max-response-len", r.rollout_max_response_len),
                        ("--eval-max-response-len", cfg.eval.eval_max_response_len)):
        if value is not None and value >= r.vllm_max_model_len:
            raise ConfigError(f"{flag} {value} leaves no room for the prompt within --vllm-max-model-len "
                              f"{r.vllm_max_model_len}; give less than {r.vllm_max_model_len}")
    if r.rollout_max_context_len is not None and r.rollout_max_context_len > r.vllm_max_model_len:
        raise ConfigError(f"--rollout-max-context-len {r.rollout_max_context_len} is beyond --vllm-max-model-len "
                          f"{r.vllm_max_model_len}; give at most {r.vllm_max_model_len}")


def _check_multi_turn_caps(cfg: EngineConfig) -> None:
    r = cfg.rollout
    for flag, value in (("--rollout-max-turns", r.rollout_max_turns),
                        ("--rollout-max-context-len", r.rollout_max_context_len)):
        if value is not None and r.custom_generate_function_path is None:
            raise ConfigError(
                f"{flag} caps multi-turn samples, which only --custom-generate-function-path makes; without it a "
                "response is one turn capped by --rollout-max-response-len: drop the flag or name a generate function"
            )


def _check_kl_flags(a: AlgorithmConfig) -> None:
    if a.kl_coef != 0 and not ESTIMATORS[a.advantage_estimator].uses_reward_kl:
        reward_kl = [name for name, spec in ESTIMATORS.items() if spec.uses_reward_kl]
        raise ConfigError(
            f"--kl-coef {a.kl_coef} is a KL penalty in the reward, which --advantage-estimator "
            f"{a.advantage_estimator} does not use: for a KL term in the loss use --use-kl-loss --kl-loss-coef "
            f"{a.kl_coef}, or use --advantage-estimator {' or '.join(reward_kl)}; else drop --kl-coef"
        )
    if a.kl_loss_coef != 0 and not a.use_kl_loss:
        raise ConfigError(
            f"--kl-loss-coef {a.kl_loss_coef} is read only with --use-kl-loss: add --use-kl-loss, or drop "
            "--kl-loss-coef"
        )
