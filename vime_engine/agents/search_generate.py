"""A search-augmented custom generate function in vime's style (its search-r1 example, in two turns):
`--custom-generate-function-path vime_engine.agents.search_generate:generate`, with `--rollout-mode server`.

Every episode consults the retriever once, between the model's two turns. The first turn may steer the query
with `<search>QUERY</search>`; without one the sample's question is searched (`metadata["question"]`, else the
prompt). The query goes to a retrieval server (its URL from the sample's `metadata["search_url"]`, else the
environment's VIMEFLOW_SEARCH_URL; retrieval_server.py is a small one), whose passages come back as
`<information>...</information>` tokens (loss mask 0), and the model answers in its second turn. Status: that of
the second turn (COMPLETED when it ended by itself, TRUNCATED when it ran out of tokens), TRUNCATED when the
passages would fill the context, ABORTED when the round was cut off.
"""

from __future__ import annotations

import os
import re
from typing import Any

from vime.utils.http_utils import post
from vime.utils.types import Sample

from vime_engine.agents.vime_turns import append_observation, finish, model_turn
from vime_engine.rollout.custom_generate import TOOL_CALLS

SEARCH_URL_KEY = "search_url"
SEARCH_URL_ENV = "VIMEFLOW_SEARCH_URL"
TOPK = 3
_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)


def search_url(sample: Sample) -> str:
    url = sample.metadata.get(SEARCH_URL_KEY) or os.environ.get(SEARCH_URL_ENV)
    if not url:
        raise ValueError(f"search_generate: no retrieval server: set the sample's metadata[{SEARCH_URL_KEY!r}] or "
                         f"{SEARCH_URL_ENV} (python -m vime_engine.agents.retrieval_server serves a small corpus)")
    return url


def information(passages: list[dict[str, Any]]) -> str:
    """The passages as the model reads them after its search."""
    docs = "\n".join(f"Doc {i}(Title: {p['title']}) {p['text']}" for i, p in enumerate(passages, 1))
    return f"\n\n<information>{docs or 'No passage matches the query.'}</information>\n\n"


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    if args.partial_rollout:
        raise ValueError("search_generate cannot continue a turn cut off in an earlier rollout: drop "
                         "--partial-rollout")
    reason, turn = await model_turn(args, sample, sampling_params)
    if reason == "abort":
        return finish(sample, reason)
    asked = _SEARCH.search(turn)
    query = asked.group(1).strip() if asked else sample.metadata.get("question") or sample.prompt
    answer = await post(search_url(sample), {"query": query, "topk": TOPK})
    if not append_observation(args, sample, information(answer["passages"])):
        return finish(sample, "length")
    sample.metadata[TOOL_CALLS] = 1
    reason, _ = await model_turn(args, sample, sampling_params)
    return finish(sample, reason)
