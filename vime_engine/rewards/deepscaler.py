"""`--rm-type deepscaler`: only the text after the reasoning (`</think>`) is graded."""

from __future__ import annotations

from vime_engine.rewards.math import math_reward

THINK_END = "</think>"


def deepscaler_reward(response: str, label: str) -> float:
    """`math_reward` of the text after the last `</think>`; 0.0 when there is no `</think>`.

    Ignoring the reasoning stops a boxed guess inside the thinking from earning reward, and a
    response that never closes its reasoning (truncated, or format not followed) earns nothing.
    """
    _, separator, answer_part = response.rpartition(THINK_END)
    if not separator:
        return 0.0
    return math_reward(answer_part, label)
