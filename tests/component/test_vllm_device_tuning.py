"""vLLM on CPU takes the device's settings (eager, whole prompts, no prefix cache) and honours an override.

The engines run in a fresh process (`python -m tests.component.test_vllm_device_tuning MODEL`), as inside the
actors: vLLM's CPU platform walks every imported module when it starts, and in the test process that includes
Flask's application proxies (moto's server), which raise when touched outside an application.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cached_tokens_of_n_samples(engine, n: int = 4) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import tokens_input

    prompt = [5 + i % 200 for i in range(300)]  # more than two of the CPU's 128-token KV blocks
    outputs = engine.llm.generate([tokens_input(prompt)] * n, [SamplingParams(max_tokens=1, seed=j) for j in range(n)],
                                  use_tqdm=False)
    engine.llm.reset_prefix_cache()
    return [o.num_cached_tokens for o in outputs]


def _probe(model: str) -> dict:
    from vime_engine.rollout.vllm_engine import DeviceTuning, EngineSettings, VLLMEngine

    report = {}
    for name, tuning in (("default", DeviceTuning()), ("cached", DeviceTuning(enable_prefix_caching=True))):
        engine = VLLMEngine(EngineSettings(model, kv_cache_bytes=1 << 28, tuning=tuning))
        config = engine.llm.llm_engine.vllm_config
        report[name] = {
            "enforce_eager": config.model_config.enforce_eager,
            "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
            "whole_prompts": config.scheduler_config.max_num_batched_tokens >= config.model_config.max_model_len,
            "prefix_caching": config.cache_config.enable_prefix_caching,
            "cached_tokens": _cached_tokens_of_n_samples(engine),
        }
    return report


@pytest.fixture(scope="module")
def engines(tiny_model) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = subprocess.run([sys.executable, "-m", "tests.component.test_vllm_device_tuning", str(tiny_model)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-5000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_cpu_engine_runs_eager_whole_prompts_without_a_prefix_cache(engines):
    default = engines["default"]
    assert default["enforce_eager"] and not default["chunked_prefill"] and default["whole_prompts"]
    assert not default["prefix_caching"]
    assert default["cached_tokens"] == [0, 0, 0, 0]


def test_with_prefix_caching_the_n_samples_of_a_prompt_read_its_blocks(engines):
    cached = engines["cached"]
    assert cached["prefix_caching"]
    first, *others = cached["cached_tokens"]
    assert first == 0 and all(count >= 256 for count in others)


if __name__ == "__main__":
    print(json.dumps(_probe(sys.argv[1])))
