"""A search agent written against the OpenAI Python SDK, trained through the run's router (`--rollout-mode server`):
`--custom-generate-function-path vime_engine.agents.openai_search_agent:generate`.

`research` is the agent, and knows nothing of training: given an `openai.AsyncOpenAI` client, it asks the model for
a search query (`<search>QUERY</search>`; without one the question itself is searched), runs the search tool, gives
the results back as a tool message (rendered by the model's chat template) and asks for the answer: two chat
completions per episode. `generate` is vime's custom generate function that runs one episode of it per sample in a
ChatSession (chat_session.py), which makes the episode one Sample: the model's two answers trained (loss mask 1),
the chat template's glue and the search results not (loss mask 0). The retrieval server is named by the sample's
`metadata["search_url"]` (or VIMEFLOW_SEARCH_URL; retrieval_server.py serves a small corpus).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from vime_engine.agents.chat_session import ChatSession, ContextFull
from vime_engine.agents.retrieval_server import DEFAULT_TOPK, SEARCH_TAG, information, search_url
from vime_engine.rollout.custom_generate import TOOL_CALLS
from vime_engine.sample import Sample

SYSTEM = ("You answer questions with a search engine. First write a search query as <search>QUERY</search>; "
          "the results come back to you; then answer.")


async def research(client: Any, model: str, question: str, search: Callable[[str], Awaitable[str]]) -> str:
    """One episode with the OpenAI SDK's `client` (an `openai.AsyncOpenAI`): a query, the search, the answer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    asked = await client.chat.completions.create(model=model, messages=messages)
    turn = asked.choices[0].message.content or ""
    wanted = SEARCH_TAG.search(turn)
    results = await search(wanted.group(1).strip() if wanted else question)
    messages += [{"role": "assistant", "content": turn}, {"role": "tool", "tool_call_id": "search", "content": results}]
    answered = await client.chat.completions.create(model=model, messages=messages)
    return answered.choices[0].message.content or ""


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    url = search_url(sample)

    async def search(query: str) -> str:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            answer = await http.post(url, json={"query": query, "topk": DEFAULT_TOPK})
            return information(answer.raise_for_status().json()["passages"])

    session = ChatSession.of(args, sample, sampling_params)
    truncated = False
    async with session.client() as client:
        try:
            await research(client, args.hf_checkpoint, sample.metadata.get("question") or sample.prompt, search)
        except ContextFull:  # no room for the next turn: the episode ends here
            truncated = True
    sample = session.into(sample, args.rollout_engine.weight_version, truncated)
    sample.metadata[TOOL_CALLS] = int(len(session.turns) > 1)
    return sample
