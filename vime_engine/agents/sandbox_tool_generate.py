"""A code-running custom generate function in vime's style (its retool example, on our sandbox):
`--custom-generate-function-path vime_engine.agents.sandbox_tool_generate:generate`, with `--rollout-mode server`.

When a turn of the model holds a fenced Python block, the block runs in the code sandbox
(vime_engine/rewards/sandbox.py: no network, no files outside its own directory, CPU/memory/time limits), and what
it printed, or its error, comes back as `<output>...</output>` tokens (loss mask 0) before the model's next turn.
A turn without code ends the episode (COMPLETED). TRUNCATED: a turn ran out of tokens, the output would fill the
context, or the model wrote code in its last allowed turn (--rollout-max-turns, default DEFAULT_MAX_TURNS), with
no turn left to read the output. ABORTED: the round was cut off.
"""

from __future__ import annotations

import asyncio
from typing import Any

from vime.utils.types import Sample

from vime_engine.agents.vime_turns import append_observation, finish, model_turn
from vime_engine.rewards.code import extract_code
from vime_engine.rewards.sandbox import SandboxLimits, run_python
from vime_engine.rollout.custom_generate import TOOL_CALLS, model_turns

DEFAULT_MAX_TURNS = 3
LIMITS = SandboxLimits()  # the sandbox's defaults: 5 s of CPU, 10 s of wall-clock time, 1 GiB
# The sandbox keeps only the program's stderr (its tail): printing there brings the output back with any error.
_PRINT_TO_STDERR = "import sys\nsys.stdout = sys.stderr\n"


async def run_code(code: str) -> str:
    """What `code` printed in the sandbox, and its error if it failed; in a thread, so other samples go on."""
    result = await asyncio.to_thread(run_python, _PRINT_TO_STDERR + code, "", LIMITS)
    if result.timed_out:
        return f"{result.stderr_tail}\ntimed out after {LIMITS.wall_seconds:g} s".strip()
    return result.stderr_tail.strip() or "(no output)"


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    if args.partial_rollout:
        raise ValueError("sandbox_tool_generate cannot continue a turn cut off in an earlier rollout: drop "
                         "--partial-rollout")
    max_turns = args.rollout_max_turns or DEFAULT_MAX_TURNS
    sample.metadata[TOOL_CALLS] = 0
    while True:
        reason, text = await model_turn(args, sample, sampling_params)
        code = extract_code(text)
        if reason != "stop" or code is None:
            return finish(sample, reason)
        if model_turns(sample.loss_mask) >= max_turns:
            return finish(sample, "length")  # code written with no turn left to read its output
        if not append_observation(args, sample, f"\n<output>\n{await run_code(code)}\n</output>\n"):
            return finish(sample, "length")
        sample.metadata[TOOL_CALLS] += 1
