"""The built-in agent: a conversation with a calculator, written as vime's custom generate function.

`--custom-generate-function-path vime_engine.agents.calculator_agent:generate` (configs/agent-demo.yaml) runs it
on the built-in `calculator` task, and it is the example for writing one: a function of vime's signature that
calls the engine through `args.rollout_engine` (vime_engine/rollout/custom_generate.py says why).

An episode: the model takes a turn; if its turn holds `<tool_call>EXPRESSION</tool_call>`, the calculator's
result is appended as a tool message, `<tool_response>VALUE</tool_response>`, rendered by the chat template
(loss_mask 0), and the model takes the next turn; a turn without a tool call ends the episode. The sample is
TRUNCATED when a turn runs out of tokens (`max_new_tokens` a turn, `--rollout-max-context-len` in all), or the
model asks for the tool after its last allowed turn (`--rollout-max-turns`, default `DEFAULT_MAX_TURNS`).

Partial rollout: cut off mid-turn, the function returns the sample as it stands (status ABORTED); called again
with it in a later rollout, it reads where it was from the sample itself, a trailing run of trained tokens being
an unfinished turn, and carries on. Nothing else is kept between calls, so the checkpoint's buffer holds it all.
"""

from __future__ import annotations

from typing import Any

from vime_engine.agents.calculator import find_tool_call, reply
from vime_engine.agents.chat_turns import tool_reply_tokens
from vime_engine.rewards.gsm8k import gsm8k_reward
from vime_engine.rollout.custom_generate import TOOL_CALLS, model_turns
from vime_engine.sample import Sample, SampleStatus

DEFAULT_MAX_TURNS = 3
RESPONSE_END = "</tool_response>"


def open_turn_length(loss_mask: list[int]) -> int:
    """Trained tokens at the end of the response: the model's turn under way (0 right after a tool reply)."""
    n = 0
    for m in reversed(loss_mask):
        if not m:
            break
        n += 1
    return n


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    engine = args.rollout_engine
    per_turn = int(sampling_params["max_new_tokens"])
    max_turns = args.rollout_max_turns or DEFAULT_MAX_TURNS
    sample.metadata.setdefault(TOOL_CALLS, 0)
    while True:
        so_far = open_turn_length(sample.loss_mask)
        out = await engine.generate(sample.prompt_tokens + sample.response_tokens,
                                    {**sampling_params, "max_new_tokens": per_turn - so_far})
        sample.append_response_tokens(args, tokens=out.token_ids, log_probs=out.log_probs, meta_info=out.meta_info)
        if out.finish_reason == "abort":
            sample.status = SampleStatus.ABORTED
            return sample
        if out.finish_reason == "length":
            sample.status = SampleStatus.TRUNCATED
            return sample
        tokens = sample.response_tokens
        turn = engine.tokenizer.decode(tokens[len(tokens) - open_turn_length(sample.loss_mask):])
        expression = find_tool_call(turn)
        if expression is None:
            sample.status = SampleStatus.COMPLETED
            return sample
        tool = tool_reply_tokens(engine.tokenizer, f"<tool_response>{reply(expression)}{RESPONSE_END}")
        cap = args.rollout_max_context_len
        if model_turns(sample.loss_mask) >= max_turns or (cap and sample.total_length + len(tool) >= cap):
            sample.status = SampleStatus.TRUNCATED  # it asked for the tool with no turn left to use the answer
            return sample
        sample.append_response_tokens(args, tokens=tool, trainable=False)
        sample.metadata[TOOL_CALLS] += 1


def final_answer_reward(response: str, label: str) -> float:
    """1.0 if the model's last turn ends on the label's number (gsm8k grading), else 0.0.

    Only the text after the last tool reply is graded: the calculator's own output must not earn the reward, so an
    episode that ends on a tool call, or restates no number after the reply, scores 0.
    """
    return gsm8k_reward(response.rpartition(RESPONSE_END)[2], label)
