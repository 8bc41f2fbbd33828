"""What the built-in vime-style agents (search_generate.py, sandbox_tool_generate.py) share: a model turn posted
to the router, a tool's answer appended, the sample's status from why a turn ended.

Written against vime's plugin contract only (`vime.*` imports, which land on vime_engine/plugins/vime_modules/
where vime is not installed; `args.vllm_router_ip`/`vllm_router_port`; vime's Sample names), the way a user's
vime plugin is, so they show and test that such a file runs here. They talk to the engine over HTTP, so they need
`--rollout-mode server`; calculator_agent.py is the in-process agent (`args.rollout_engine`).
"""

from __future__ import annotations

from typing import Any

from vime.rollout.vllm_rollout import (
    GenerateState,
    _build_inference_sampling_params,
    _inference_generate_tokens_and_logprobs,
    _vllm_meta_from_generate_choice,
)
from vime.utils.http_utils import post
from vime.utils.types import Sample

_STATUS = {"stop": Sample.Status.COMPLETED, "length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED}


def context_limit(args: Any) -> int | None:
    """The most tokens a sample may hold: --rollout-max-context-len or the engine's context, the smaller given."""
    limits = [n for n in (args.rollout_max_context_len, args.vllm_max_model_len) if n]
    return min(limits) if limits else None


async def model_turn(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> tuple[str, str]:
    """The model's next turn, generated after all of `sample` so far and appended to it (loss mask 1, with its
    log-probs): why it ended ("stop", "length" or "abort") and its text."""
    if args.vllm_router_ip is None:
        raise ValueError("this generate function posts to the rollout router: run it with --rollout-mode server")
    limit = context_limit(args)
    budget = int(sampling_params["max_new_tokens"])
    if limit is not None:
        budget = min(budget, limit - len(sample.tokens))
    if budget <= 0:
        return "length", ""
    url = f"http://{args.vllm_router_ip}:{args.vllm_router_port}/inference/v1/generate"
    payload = {"token_ids": sample.tokens,
               "sampling_params": _build_inference_sampling_params({**sampling_params, "max_new_tokens": budget})}
    # The group as the session: the router's consistent hash keeps a prompt's samples where its blocks are cached.
    output = await post(url, payload, headers={"x-session-id": str(sample.group_index)})
    choice = output["choices"][0]
    tokens, log_probs = _inference_generate_tokens_and_logprobs(choice)
    meta = _vllm_meta_from_generate_choice(args, choice)
    text = GenerateState(args).tokenizer.decode(tokens)
    if tokens:
        sample.append_response_tokens(args, tokens=tokens, log_probs=log_probs, meta_info=meta)
        sample.response += text
    return meta["finish_reason"]["type"], text


def append_observation(args: Any, sample: Sample, text: str) -> bool:
    """`text`, a tool's answer, appended as tokens the model did not sample (loss mask 0); False, appending
    nothing, when the sample would then leave no room for the model's next turn."""
    tokens = GenerateState(args).tokenizer(text, add_special_tokens=False)["input_ids"]
    limit = context_limit(args)
    if limit is not None and len(sample.tokens) + len(tokens) >= limit:
        return False
    sample.append_response_tokens(args, tokens=tokens, trainable=False)
    sample.response += text
    return True


def finish(sample: Sample, reason: str) -> Sample:
    """`sample` with the status that a turn ending for `reason` gives it."""
    sample.status = _STATUS[reason]
    return sample
