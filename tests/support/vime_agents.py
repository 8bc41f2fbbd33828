"""The agents of vime_engine/agents/ that talk to the router themselves, in one run, unchanged: the two vime-style
plugin files and the OpenAI-SDK agent take the groups in turn (`--custom-generate-function-path
tests/support/vime_agents.py:generate`). They post to the router, so the run needs `--rollout-mode server`."""

from vime_engine.agents import openai_search_agent, sandbox_tool_generate, search_generate

AGENTS = (search_generate, sandbox_tool_generate, openai_search_agent)  # group i: AGENTS[i % 3]


async def generate(args, sample, sampling_params):
    return await AGENTS[sample.group_index % len(AGENTS)].generate(args, sample, sampling_params)
