"""Both vime-style agents of vime_engine/agents/ in one run, unchanged: the search agent generates the even
groups, the sandbox agent the odd ones (`--custom-generate-function-path tests/support/vime_agents.py:generate`).
They post to the router themselves, so the run needs `--rollout-mode server`."""

from vime_engine.agents import sandbox_tool_generate, search_generate


async def generate(args, sample, sampling_params):
    agent = search_generate if sample.group_index % 2 == 0 else sandbox_tool_generate
    return await agent.generate(args, sample, sampling_params)
