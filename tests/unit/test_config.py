"""EngineConfig: vime flags, YAML, validation messages that name the flag and the fix."""

from __future__ import annotations

import pytest

from vime_engine.config import ConfigError, build_config, from_flat, parse_flags, with_overrides

REQUIRED = {"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl"}

# vime's Qwen3-4B GRPO launch flags (run-qwen3-4B.sh), with the model and data paths swapped for local ones.
QWEN3_4B_SCRIPT = """
--hf-checkpoint /models/m --ref-load /models/m --load /ckpt --save /ckpt --save-interval 20
--prompt-data /data/p.jsonl --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
--rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
--rollout-max-response-len 8192 --rollout-temperature 0.8 --global-batch-size 256 --balance-data
--eval-interval 20 --eval-prompt-data aime /data/aime.jsonl --n-samples-per-eval-prompt 16
--eval-max-response-len 16384 --eval-top-p 0.7
--use-dynamic-batch-size --max-tokens-per-gpu 9216
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--rollout-num-gpus-per-engine 2 --vllm-gpu-memory-utilization 0.7 --train-memory-margin-bytes 1073741824
--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
""".split()
QWEN3_DISAGGREGATED = [flag for flag in QWEN3_4B_SCRIPT if flag != "--colocate"]


def test_vime_qwen3_4b_script_parses_with_vime_meanings():
    # Colocated: 4 engines of two devices, each tensor parallel across two of the 8 ranks; of one device, 8.
    assert build_config(QWEN3_4B_SCRIPT).rollout_engines == 4
    assert build_config([*QWEN3_4B_SCRIPT, "--rollout-num-gpus-per-engine", "1"]).rollout_engines == 8
    cfg = build_config(QWEN3_DISAGGREGATED)
    assert cfg.rollout.rollout_batch_size == 32 and cfg.rollout.n_samples_per_prompt == 8
    assert cfg.global_batch_size == 256 and cfg.samples_per_rollout // cfg.global_batch_size == 1
    assert cfg.algorithm.kl_loss_type == "low_var_kl" and cfg.algorithm.use_kl_loss
    assert cfg.eps_clip_high == 0.28
    assert cfg.eval_datasets == [("aime", "/data/aime.jsonl")]
    assert cfg.train.use_dynamic_batch_size and cfg.trainer_world_size == cfg.data_parallel_size == 8


def test_megatron_flags_pass_through_to_the_megatron_section_with_their_types():
    cfg = build_config([*QWEN3_DISAGGREGATED, "--train-backend", "megatron", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel", "--recompute-granularity", "full", "--recompute-num-layers", "4",
                        "--accumulate-allreduce-grads-in-fp32=false"])
    assert cfg.megatron == {"tensor-model-parallel-size": 2, "sequence-parallel": True,
                            "recompute-granularity": "full", "recompute-num-layers": 4,
                            "accumulate-allreduce-grads-in-fp32": False}
    assert cfg.data_parallel_size == 4


def test_megatrons_older_flash_attention_switch_and_its_fusion_switch_reach_the_layout():
    # the NPU scripts pass --use-flash-attn beside --attention-backend flash; the ROCm one turns fusion off
    from vime_engine.train.megatron_layout import MegatronSetupError, ParallelLayout

    flags = ["--train-backend", "megatron", "--use-flash-attn", "--no-gradient-accumulation-fusion"]
    layout = ParallelLayout.from_flags(build_config([*QWEN3_DISAGGREGATED, *flags]).megatron)
    assert layout.attention_backend == "flash" and not layout.gradient_accumulation_fusion
    default = ParallelLayout.from_flags({})
    assert default.gradient_accumulation_fusion and default.attention_backend is None
    with pytest.raises(MegatronSetupError, match="--use-flash-attn asks for --attention-backend flash, and "
                                                 "--attention-backend local asks for another"):
        ParallelLayout.from_flags({"use-flash-attn": True, "attention-backend": "local"})


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "3"], "8 trainer ranks do not split into .* groups of 3"),
    (["--pipeline-model-parallel-size", "2", "--global-batch-size", "2", "--n-samples-per-prompt", "8"],
     "--global-batch-size 2 does not split over 4 data-parallel ranks"),
    (["--recompute-num-layers", "four"], "--recompute-num-layers 'four': expected an integer"),
    (["--sequence-parallel=maybe"], "--sequence-parallel 'maybe': expected true or false"),
])
def test_impossible_parallel_layouts_fail_naming_the_flags(flags, message):
    with pytest.raises(ConfigError, match=message):
        build_config([*QWEN3_DISAGGREGATED, "--train-backend", "megatron", *flags])


def test_parallel_sizes_need_the_megatron_backend():
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size 2 need --train-backend megatron"):
        build_config([*QWEN3_DISAGGREGATED, "--tensor-model-parallel-size", "2"])


def test_megatron_to_hf_mode_needs_the_megatron_backend_and_takes_its_two_values():
    with pytest.raises(ConfigError, match="--megatron-to-hf-mode bridge converts a Megatron model's weights; the "
                                          "torch backend trains the HF model itself"):
        build_config([*QWEN3_DISAGGREGATED, "--megatron-to-hf-mode", "bridge"])
    with pytest.raises(ConfigError, match="--megatron-to-hf-mode"):
        build_config([*QWEN3_DISAGGREGATED, "--train-backend", "megatron", "--megatron-to-hf-mode", "core"])
    cfg = build_config([*QWEN3_DISAGGREGATED, "--train-backend", "megatron", "--megatron-to-hf-mode", "bridge"])
    assert cfg.train.megatron_to_hf_mode == "bridge" and "megatron_to_hf_mode" not in cfg.math_fields()


def test_unknown_flag_names_a_close_match():
    with pytest.raises(ConfigError, match=r"unknown flag --rollout-batchsize \(did you mean --rollout-batch-size\?\)"):
        parse_flags(["--rollout-batchsize", "4"])


def test_global_batch_must_divide_the_rollout():
    with pytest.raises(ConfigError, match=r"--global-batch-size 5 does not divide .* = 8; use one of \[1, 2, 4, 8\]"):
        from_flat({**REQUIRED, "rollout-batch-size": 2, "n-samples-per-prompt": 4, "global-batch-size": 5})


def test_bad_value_names_the_flag():
    with pytest.raises(ConfigError, match=r"--rollout-temperature 'hot'"):
        build_config(["--rollout-temperature", "hot"], **REQUIRED)


def test_missing_required_flags_are_listed():
    with pytest.raises(ConfigError, match="missing required --hf-checkpoint"):
        build_config(["--prompt-data", "x.jsonl"])


@pytest.mark.parametrize("flags, message", [
    (["--n-samples-per-prompt", "1", "--rollout-batch-size", "4"], "set --n-samples-per-prompt to 2 or more"),
    (["--async-rollout", "--colocate"], "--async-rollout needs the rollout engine on its own actor"),
    (["--save-interval", "2"], "--save-interval needs --save DIR"),
    (["--eval-prompt-data", "aime"], "--eval-prompt-data takes pairs"),
    (["--eps-clip-c", "0.5"], "--eps-clip-c"),
    (["--partial-rollout"], "set --over-sampling-batch-size larger than --rollout-batch-size"),
    (["--partial-rollout", "--rollout-batch-size", "4", "--over-sampling-batch-size", "4"],
     "--partial-rollout cuts off"),
    (["--partial-rollout", "--rollout-batch-size", "4", "--over-sampling-batch-size", "6", "--async-rollout"],
     "--async-rollout generates the next rollout unwatched"),
])
def test_impossible_combinations(flags, message):
    with pytest.raises(ConfigError, match=message):
        build_config(flags, **REQUIRED)


def test_partial_rollout_needs_over_sampling_and_runs_with_it():
    cfg = build_config(["--partial-rollout", "--rollout-batch-size", "4", "--over-sampling-batch-size", "6"],
                       **REQUIRED)
    assert cfg.rollout.partial_rollout and "partial_rollout" in cfg.math_fields()


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("hf-checkpoint: /m\nprompt_data: /p.jsonl\nrollout-batch-size: 4\nlr: 1.0e-5\n")
    cfg = build_config(["--lr", "2e-5"], yaml_path=path)
    assert cfg.rollout.rollout_batch_size == 4 and cfg.train.lr == 2e-5


def test_math_hash_ignores_run_length_but_not_the_learning_rate():
    base = from_flat({**REQUIRED, "num-rollout": 4})
    assert base.math_hash() == with_overrides(base, num_rollout=40, save="/elsewhere").math_hash()
    changed = with_overrides(base, lr=1e-3)
    assert changed.math_hash() != base.math_hash()
    assert changed.math_diff(base.math_fields()) == ["--lr: 1e-06 -> 0.001"]
    decaying = with_overrides(base, lr_decay_style="cosine")  # the run length now shapes the LR schedule
    assert with_overrides(decaying, num_rollout=40).math_hash() != decaying.math_hash()


def test_math_hash_ignores_the_data_parallel_layout_but_not_the_backend_family():
    base = from_flat({**REQUIRED, "num-rollout": 4})
    sharded = with_overrides(base, train_backend="fsdp", actor_num_gpus_per_node=2)
    assert sharded.math_hash() == base.math_hash() and sharded.math_diff(base.math_fields()) == []
    assert with_overrides(base, train_backend="megatron").math_diff(base.math_fields()) == [
        "--train-backend: 'torch' -> 'megatron'"]
