"""`--rm-type math`: the last `\\boxed{}` of the response, graded against the label."""

from __future__ import annotations

from vime_engine.rewards.boxed import last_boxed_content
from vime_engine.rewards.grading import answers_match


def math_reward(response: str, label: str) -> float:
    """1.0 if the response's last `\\boxed{...}` (or `\\fbox{...}`) equals `label`, else 0.0.

    A response without a boxed answer scores 0.0. A label that itself carries a `\\boxed{}`
    (as MATH solutions do) is reduced to that box's content first.
    """
    answer = last_boxed_content(response)
    if answer is None or not answer.strip():
        return 0.0
    gold = last_boxed_content(label)
    return 1.0 if answers_match(answer, gold if gold is not None else label) else 0.0
