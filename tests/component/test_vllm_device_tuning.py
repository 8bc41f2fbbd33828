"""vLLM on CPU takes the device's settings (eager, whole prompts, no prefix cache) and honours an override."""

from __future__ import annotations

import os

import pytest

from vime_engine.rollout.vllm_engine import DeviceTuning, EngineSettings, VLLMEngine


@pytest.fixture(scope="module")
def engines(tiny_model):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process, as inside the actors
    settings = EngineSettings(str(tiny_model), kv_cache_bytes=1 << 28)
    default = VLLMEngine(settings)
    cached = VLLMEngine(EngineSettings(str(tiny_model), kv_cache_bytes=1 << 28,
                                       tuning=DeviceTuning(enable_prefix_caching=True)))
    return default, cached


def _cached_tokens_of_n_samples(engine: VLLMEngine, n: int = 4) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import tokens_input

    prompt = [5 + i % 200 for i in range(300)]  # more than two of the CPU's 128-token KV blocks
    outputs = engine.llm.generate([tokens_input(prompt)] * n, [SamplingParams(max_tokens=1, seed=j) for j in range(n)],
                                  use_tqdm=False)
    engine.llm.reset_prefix_cache()
    return [o.num_cached_tokens for o in outputs]


def test_the_cpu_engine_runs_eager_whole_prompts_without_a_prefix_cache(engines):
    default, _ = engines
    config = default.llm.llm_engine.vllm_config
    assert config.model_config.enforce_eager
    assert not config.scheduler_config.enable_chunked_prefill
    assert config.scheduler_config.max_num_batched_tokens >= config.model_config.max_model_len
    assert not config.cache_config.enable_prefix_caching
    assert _cached_tokens_of_n_samples(default) == [0, 0, 0, 0]


def test_with_prefix_caching_the_n_samples_of_a_prompt_read_its_blocks(engines):
    _, cached = engines
    assert cached.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    first, *others = _cached_tokens_of_n_samples(cached)
    assert first == 0 and all(count >= 256 for count in others)
