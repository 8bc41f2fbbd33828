"""vLLM's graph, cache and scheduler settings: the device's best unless a flag says otherwise."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from vime_engine.config import ConfigError, build_config
from vime_engine.rollout.vllm_engine import DeviceTuning, device_engine_kwargs, vllm_engine_args
from vime_engine.rollout.worker import engine_settings

AUTO = DeviceTuning()


def test_cpu_keeps_whole_prompt_eager_uncached_scheduling():
    assert device_engine_kwargs("cpu", AUTO, max_model_len=2048) == {
        "enforce_eager": True, "enable_prefix_caching": False, "enable_chunked_prefill": False,
        "max_num_batched_tokens": 16384,
    }
    # A step must fit the longest prompt whole.
    assert device_engine_kwargs("cpu", AUTO, max_model_len=32768)["max_num_batched_tokens"] == 32768


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_accelerators_get_graphs_prefix_caching_and_chunked_prefill(device):
    # No max_num_batched_tokens: vLLM sizes the chunked-prefill budget for the device itself.
    assert device_engine_kwargs(device, AUTO, max_model_len=4096) == {
        "enforce_eager": False, "enable_prefix_caching": True, "enable_chunked_prefill": True,
    }


@pytest.mark.parametrize("device", ["cpu", "cuda", "npu"])
def test_a_given_value_wins_over_the_device_choice(device):
    tuning = DeviceTuning(enforce_eager=device != "cpu", enable_prefix_caching=device == "cpu",
                          enable_chunked_prefill=False, max_num_batched_tokens=8192)
    assert device_engine_kwargs(device, tuning, max_model_len=4096) == {
        "enforce_eager": device != "cpu", "enable_prefix_caching": device == "cpu", "enable_chunked_prefill": False,
        "max_num_batched_tokens": 8192,
    }
    chunked = device_engine_kwargs("cuda", DeviceTuning(max_num_batched_tokens=2048), max_model_len=4096)
    assert chunked["enable_chunked_prefill"] and chunked["max_num_batched_tokens"] == 2048


def test_chunked_prefill_on_cpu_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--vllm-enable-chunked-prefill true cannot run on CPU"):
        device_engine_kwargs("cpu", DeviceTuning(enable_chunked_prefill=True), max_model_len=1024)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_budget_below_the_model_length_without_chunked_prefill_is_refused(device):
    tuning = DeviceTuning(enable_chunked_prefill=False, max_num_batched_tokens=1024)
    with pytest.raises(ValueError, match="--vllm-max-num-batched-tokens 1024 is below the model length 4096"):
        device_engine_kwargs(device, tuning, max_model_len=4096)


def test_the_flags_reach_the_engine_settings():
    base = {"hf-checkpoint": "model", "prompt-data": "data.jsonl"}
    assert engine_settings(build_config([], **base), None).tuning == AUTO
    cfg = build_config(["--vllm-enforce-eager", "false", "--vllm-enable-prefix-caching",
                        "--vllm-enable-chunked-prefill=auto", "--vllm-max-num-batched-tokens", "8192"], **base)
    assert engine_settings(cfg, None).tuning == DeviceTuning(
        enforce_eager=False, enable_prefix_caching=True, enable_chunked_prefill=None, max_num_batched_tokens=8192)


@pytest.mark.parametrize(("flags", "message"), [
    (["--vllm-enforce-eager=maybe"], "--vllm-enforce-eager 'maybe': expected true, false or auto"),
    (["--vllm-max-num-batched-tokens", "0"], "--vllm-max-num-batched-tokens '0': expected a positive integer or auto"),
])
def test_bad_values_name_the_flag(flags, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_config(flags, **{"hf-checkpoint": "model", "prompt-data": "data.jsonl"})


def test_vimes_vllm_flags_reach_vllms_arguments_on_an_accelerator_and_are_refused_where_they_cannot_act():
    # run-qwen3-32B.sh's graph sizes, the ai21 scripts' --vllm-max-num-seqs, the reproducibility script's backend

    cfg = build_config(["--vllm-max-model-len", "512", "--vllm-max-num-seqs", "64", "--vllm-cudagraph-capture-sizes",
                        "1", "2", "4", "--vllm-attention-backend", "flashinfer"],
                       **{"hf-checkpoint": "model", "prompt-data": "data.jsonl"})
    args = vllm_engine_args(engine_settings(cfg, None), "cuda", sleep_mode_available=True)
    assert (args["max_num_seqs"], args["cudagraph_capture_sizes"], args["attention_backend"]) == (64, [1, 2, 4],
                                                                                                 "FLASHINFER")
    with pytest.raises(ValueError, match="--vllm-cudagraph-capture-sizes 1 2 4: the engine runs eagerly on cpu"):
        vllm_engine_args(engine_settings(cfg, None), "cpu", sleep_mode_available=False)
    base = {"hf-checkpoint": "model", "prompt-data": "data.jsonl"}
    eager = build_config(["--vllm-max-model-len", "512", "--vllm-enforce-eager", "true",
                          "--vllm-cudagraph-capture-sizes", "8"], **base)
    with pytest.raises(ValueError, match="runs eagerly on cuda"):
        vllm_engine_args(engine_settings(eager, None), "cuda", sleep_mode_available=True)
    on_cpu = build_config(["--vllm-max-model-len", "512", "--vllm-attention-backend", "flashinfer"],
                          **{"hf-checkpoint": "model", "prompt-data": "data.jsonl"})
    with pytest.raises(ValueError, match="--vllm-attention-backend flashinfer: on CPU vLLM runs attention with "
                                         "CPU_ATTN"):
        vllm_engine_args(engine_settings(on_cpu, None), "cpu", sleep_mode_available=False)
def test_rollout_routing_replay_asks_vllm_for_the_routed_experts():
    base = {"hf-checkpoint": "model", "prompt-data": "data.jsonl"}
    assert not engine_settings(build_config([], **base), None).return_routed_experts
    settings = replace(engine_settings(build_config(["--use-rollout-routing-replay"], **base), None), max_model_len=64)
    assert settings.return_routed_experts
    assert vllm_engine_args(settings, "cuda", False)["enable_return_routed_experts"]
    assert "enable_return_routed_experts" not in vllm_engine_args(replace(settings, return_routed_experts=False),
                                                                  "cuda", False)
