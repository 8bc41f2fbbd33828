"""A custom generate function in vime's form for tests (`--custom-generate-function-path
tests/support/two_turn_agent.py:generate`): every episode is two model turns with an environment reply between
them, whatever the model writes, so a tiny random model makes real multi-turn samples.

The first turn may take 4 up to `max_new_tokens` - 1 tokens, set by the sample's seed, so that conversations end at
different engine steps (a partial rollout then has some to cut off). It reads where a cut-off episode stood from
the sample alone (a trailing run of trained tokens is an unfinished turn), so partial rollout and a resume from the
checkpoint's buffer continue it.
"""

from vime_engine.agents.chat_turns import tool_reply_tokens
from vime_engine.rollout.custom_generate import model_turns
from vime_engine.sample import Sample

TURNS = 2


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    engine = args.rollout_engine
    longest = sampling_params["max_new_tokens"]
    while True:
        mask = sample.loss_mask
        open_turn = len(mask) - max((i + 1 for i, m in enumerate(mask) if not m), default=0)
        budget = longest if 0 in mask else 4 + sampling_params["sampling_seed"] % (longest - 4)  # 0: a reply came
        output = await engine.generate(sample.tokens, {**sampling_params, "max_new_tokens": budget - open_turn})
        sample.append_response_tokens(args, tokens=output.token_ids, log_probs=output.log_probs,
                                      meta_info=output.meta_info)
        if output.finish_reason == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        if model_turns(sample.loss_mask) == TURNS or not output.token_ids:  # done, or no room left
            sample.status = Sample.Status.TRUNCATED if output.finish_reason == "length" else Sample.Status.COMPLETED
            return sample
        reply = f"turn {model_turns(sample.loss_mask)} had {len(output.token_ids)} tokens"
        sample.append_response_tokens(args, tokens=tool_reply_tokens(engine.tokenizer, reply), trainable=False)
