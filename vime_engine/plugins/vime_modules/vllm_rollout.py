"""vime's `vime.rollout.vllm_rollout` names that custom generate plugins import (and slime's
`slime.rollout.sglang_rollout.GenerateState`), for a plugin that talks to the router itself.

A vime plugin's turn: `payload = {"token_ids": ids, "sampling_params": _build_inference_sampling_params(params)}`,
`output = await post(f"http://{args.vllm_router_ip}:{args.vllm_router_port}/inference/v1/generate", payload)`,
then `_inference_generate_tokens_and_logprobs(output["choices"][0])`. The body and the answer are
vime_engine/plugins/generate_api.py's format; each request's seed is derived from the sample's (seeded_params.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import AutoTokenizer

from vime_engine.plugins import generate_api
from vime_engine.plugins.vime_modules.misc import SingletonMeta
from vime_engine.plugins.vime_modules.seeded_params import SeededSamplingParams

# The sampling parameters a generate function is given (SGLang's names, which vime keeps) -> vLLM's.
_VLLM_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
_SEEDS = ("sampling_seed", "seed")  # the sample's seed (set by our rollout worker); a request's own (vime's)


class GenerateState(metaclass=SingletonMeta):
    """vime's per-process generation state, made on the first `GenerateState(args)`: the model's tokenizer and
    the run's sampling defaults."""

    def __init__(self, args: Any):
        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
        self.sampling_params: dict[str, Any] = dict(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len,
        )


def get_model_url(args: Any, model_name: str, endpoint: str = generate_api.PATH) -> str:
    """The URL of `endpoint` on the router serving `model_name`: a run here serves one model, so for every name
    the run's router (vime falls back to it for a name it has no router for)."""
    del model_name
    return f"http://{args.vllm_router_ip}:{args.vllm_router_port}{endpoint}"


def _build_inference_sampling_params(sampling_params: Mapping[str, Any]) -> dict[str, Any]:
    """A generate body's `sampling_params` from a generate function's: `max_new_tokens` as `max_tokens`, the
    sampled tokens' log-probs asked for, and a seed: `seed` if given, else each request's own from the sample's
    `sampling_seed`, set when the body is posted. Keys vLLM would not act on the same way are refused."""
    unknown = sorted(set(sampling_params) - set(_VLLM_NAMES) - set(_SEEDS))
    if unknown:
        raise ValueError(f"_build_inference_sampling_params: unsupported sampling parameters {unknown}; it takes "
                         f"{', '.join((*_VLLM_NAMES, *_SEEDS))}")
    settings = {"top_p": 1.0, "top_k": -1} | {_VLLM_NAMES[k]: v for k, v in sampling_params.items() if k in _VLLM_NAMES}
    seed = sampling_params.get("seed")
    params = generate_api.sampling_params(settings, seed)
    sampling_seed = sampling_params.get("sampling_seed")
    return params if seed is not None or sampling_seed is None else SeededSamplingParams(params, int(sampling_seed))


def _inference_generate_tokens_and_logprobs(choice: Mapping[str, Any]) -> tuple[list[int], list[float]]:
    """A response choice's generated token ids and their log-probs; a RuntimeError when they differ in number."""
    out = generate_api.read_choice(choice)
    return out.token_ids, out.log_probs


def _vllm_meta_from_generate_choice(args: Any, choice: Mapping[str, Any],
                                    usage: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vime's `meta_info` of a choice: `finish_reason` as `{"type": "stop" | "length" | "abort"}`, the weight
    version that generated it (which `Sample.append_response_tokens` records), and the token counts of `usage`."""
    del args  # vime's signature; nothing here depends on the run's flags
    out = generate_api.read_choice(choice)
    meta: dict[str, Any] = {"finish_reason": {"type": out.finish_reason}}
    if out.weight_version is not None:
        meta["weight_version"] = out.weight_version
    if usage:
        meta.update(prompt_tokens=usage.get("prompt_tokens", 0), completion_tokens=usage.get("completion_tokens", 0))
    return meta
