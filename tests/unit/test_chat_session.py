"""An OpenAI-API agent's episode as one Sample (vime_engine/agents/chat_session.py, openai_search_agent.py): the agent
itself (`research`, the real OpenAI SDK) against a stand-in for the router speaking vLLM's chat completions (token
ids and log-probs returned, `kv_transfer_params.prompt_token_ids` taken instead of the messages); the glue between
turns rendered through the tiny model's ChatML template."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from transformers import AutoTokenizer

from vime_engine.agents.chat_session import ChatSession, ChatTurn, ContextFull, between_turns, response_segments
from vime_engine.agents.openai_search_agent import research
from vime_engine.plugins.request_seeds import request_seed
from vime_engine.sample import ENVIRONMENT_LOG_PROB, Sample, SampleStatus

SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_between_turns_is_the_templates_glue_and_the_agents_new_messages(tokenizer):
    current = [*SYSTEM, {"role": "assistant", "content": "<search>Paris</search>"},
               {"role": "tool", "content": "France"}]
    tail = "\n<|im_start|>tool\nFrance<|im_end|>\n<|im_start|>assistant\n"
    assert between_turns(tokenizer, SYSTEM, current, ended_with_eos=False) == "<|im_end|>" + tail
    assert between_turns(tokenizer, SYSTEM, current, ended_with_eos=True) == tail  # the model wrote the EOS itself
    rewritten = [SYSTEM[0], {"role": "user", "content": "Where is Rome?"}, *current[2:]]
    with pytest.raises(ValueError, match="extend its conversation, not rewrite it"):
        between_turns(tokenizer, SYSTEM, rewritten, ended_with_eos=False)
    with pytest.raises(ValueError, match="at least one more"):
        between_turns(tokenizer, SYSTEM, current[:3], ended_with_eos=False)


def test_response_segments_need_each_prompt_to_continue_the_tokens_before_it():
    turns = [ChatTurn([], [1, 2], [3, 4], [-0.1, -0.2], "length"),
             ChatTurn([], [1, 2, 3, 4, 9, 9], [5], [-0.5], "stop")]
    assert response_segments(turns) == [([3, 4], [-0.1, -0.2]), ([9, 9], None), ([5], [-0.5])]
    retokenized = [turns[0], ChatTurn([], [1, 2, 34, 9, 9], [5], [-0.5], "stop")]
    with pytest.raises(ValueError, match="does not continue the tokens before it"):
        response_segments(retokenized)


class StandInRouter:
    """The router and a vLLM server behind it, as the session sees them: a first prompt rendered from the
    messages (here: fixed tokens), later ones taken from kv_transfer_params; answers of 3 tokens."""

    def __init__(self, first_prompt: list[int]):
        self.first_prompt, self.posted = first_prompt, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.posted.append((dict(request.headers), body))
        prompt = (body.get("kv_transfer_params") or {}).get("prompt_token_ids") or self.first_prompt
        output = [100 + len(self.posted), 101, 102]
        return httpx.Response(200, json={
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
            "prompt_token_ids": prompt,
            "choices": [{"index": 0, "finish_reason": "length", "token_ids": output,
                         "message": {"role": "assistant", "content": "<search>Paris</search>"},
                         "logprobs": {"content": [{"token": "t", "logprob": -0.25 * (i + 1), "bytes": [],
                                                   "top_logprobs": []} for i in range(len(output))]}}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": 3, "total_tokens": len(prompt) + 3}})


def _session(tokenizer, **changes) -> ChatSession:
    fields = dict(router_url="http://router", tokenizer=tokenizer, session_id="episode-4-77", sampling_seed=77,
                  max_tokens=8, context_limit=512, sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1},
                  timeout_s=10)
    return ChatSession(**{**fields, **changes})


def test_an_openai_sdk_agents_episode_becomes_one_sample_with_the_models_tokens_trained(tokenizer):
    router, session = StandInRouter(first_prompt=[7, 8, 9]), _session(tokenizer)

    async def search(query: str) -> str:
        assert query == "Paris"  # the model's <search> query reached the tool
        return "Paris is in France."

    async def episode() -> str:
        async with session.client(httpx.MockTransport(router)) as client:
            return await research(client, "tiny", "Where is Paris?", search)

    assert asyncio.run(episode()) == "<search>Paris</search>"  # the agent read vLLM's chat completion
    (first_headers, first), (second_headers, second) = router.posted
    assert first_headers["x-session-id"] == second_headers["x-session-id"] == "episode-4-77"
    assert [first["seed"], second["seed"]] == [request_seed(77, 0), request_seed(77, 1)]
    for body in (first, second):
        assert body["return_token_ids"] is True and body["logprobs"] is True
        assert (body["temperature"], body["max_completion_tokens"]) == (1.0, 8)
    assert "kv_transfer_params" not in first  # the server renders the first prompt
    glue = tokenizer(between_turns(tokenizer, first["messages"], second["messages"], ended_with_eos=False),
                     add_special_tokens=False)["input_ids"]
    assert second["kv_transfer_params"]["prompt_token_ids"] == [7, 8, 9, 101, 101, 102, *glue]

    sample = session.into(Sample(group_index=4, prompt="Where is Paris?", label="France", prompt_tokens=[1]),
                          weight_version=3)
    assert sample.prompt_tokens == [7, 8, 9]
    assert sample.response_tokens == [101, 101, 102, *glue, 102, 101, 102]
    assert sample.loss_mask == [1] * 3 + [0] * len(glue) + [1] * 3
    assert sample.rollout_log_probs == [-0.25, -0.5, -0.75, *[ENVIRONMENT_LOG_PROB] * len(glue), -0.25, -0.5, -0.75]
    assert "Paris is in France." in tokenizer.decode(glue)  # the tool's answer is in the glue, untrained
    assert sample.status is SampleStatus.TRUNCATED and sample.version_segments == [(3, 6)]


def test_the_session_refuses_what_the_trainer_cannot_use_and_a_turn_past_the_context(tokenizer):
    session = _session(tokenizer)
    with pytest.raises(ValueError, match="--rollout-temperature 1.0"):
        session.prepare({"messages": SYSTEM, "temperature": 0.7})
    with pytest.raises(ValueError, match="n=1"):
        session.prepare({"messages": SYSTEM, "n": 2})
    session.turns.append(ChatTurn(SYSTEM, list(range(500)), [1, 2, 3], [-1.0] * 3, "length"))
    more = [*SYSTEM, {"role": "assistant", "content": "x"}, {"role": "user", "content": "and?"}]
    with pytest.raises(ContextFull, match="limit being 512"):
        session.prepare({"messages": more})


def test_a_turn_past_the_context_ends_the_agents_episode_with_context_full(tokenizer):
    session = _session(tokenizer, context_limit=20)  # the first prompt (3) and answer (3) leave no room for the glue

    async def search(query: str) -> str:
        return "Paris is in France."

    async def episode() -> None:
        async with session.client(httpx.MockTransport(StandInRouter(first_prompt=[7, 8, 9]))) as client:
            await research(client, "tiny", "Where is Paris?", search)

    with pytest.raises(ContextFull):  # through the SDK's call as raised: what openai_search_agent.generate ends on
        asyncio.run(episode())
    assert len(session.turns) == 1
