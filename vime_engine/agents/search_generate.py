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

from typing import Any

from vime.utils.http_utils import post
from vime.utils.types import Sample

from vime_engine.agents.retrieval_server import DEFAULT_TOPK, SEARCH_TAG, information, search_url
from vime_engine.agents.vime_turns import append_observation, finish, model_turn
from vime_engine.rollout.custom_generate import TOOL_CALLS


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    if args.partial_rollout:
        raise ValueError("search_generate cannot continue a turn cut off in an earlier rollout: drop "
                         "--partial-rollout")
    reason, turn = await model_turn(args, sample, sampling_params)
    if reason == "abort":
        return finish(sample, reason)
    asked = SEARCH_TAG.search(turn)
    query = asked.group(1).strip() if asked else sample.metadata.get("question") or sample.prompt
    answer = await post(search_url(sample), {"query": query, "topk": DEFAULT_TOPK})
    if not append_observation(args, sample, information(answer["passages"])):
        return finish(sample, "length")
    sample.metadata[TOOL_CALLS] = 1
    reason, _ = await model_turn(args, sample, sampling_params)
    return finish(sample, reason)
