"""`--rm-type dapo`: the DAPO recipe's reward: the last `Answer: X` line, +1.0 / -1.0.

Facts checked in the DAPO reward as shipped with verl (`utils/reward_score/math_dapo.py`) and
slime (`rollout/rm_hub/math_dapo_utils.py`): the answer is the last match of a
case-insensitive `Answer:` pattern up to the end of its line, searched only in the last 300
characters of the response; both sides are normalised (Minerva-style: drop `$`, spaces,
`\\text{}`, keep the part after the last `=`), the label is an integer (slime casts it
with `int(float(label))`), and the score is 1.0 when they match and -1.0 otherwise, including
when there is no `Answer:` line at all. The prompts of DAPO-Math-17k ask for exactly that last
line. We keep the scale (+1 / -1) and the 300-character window; where the label is not an
integer we compare normalised strings instead of failing as slime's cast would, and numbers
compare by value, so `033`, `33` and `33.0` are the same answer.
"""

from __future__ import annotations

import re
from fractions import Fraction

from vime_engine.rewards.grading import normalise_latex

CORRECT = 1.0
INCORRECT = -1.0
# DAPO looks only at the response's tail: the answer line is required to be the last line.
TAIL_CHARS = 300

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def dapo_reward(response: str, label: str) -> float:
    """+1.0 if the last `Answer: X` line in the response's last 300 characters matches the
    label after normalisation, -1.0 otherwise (no answer line included)."""
    line = answer_line(response)
    if line is None:
        return INCORRECT
    answer, gold = normalise_answer(line), normalise_answer(label)
    if not answer or not gold:  # `Answer: ` with nothing after it answers nothing, even against an empty label
        return INCORRECT
    if _NUMBER.fullmatch(answer) and _NUMBER.fullmatch(gold):
        return CORRECT if Fraction(answer) == Fraction(gold) else INCORRECT
    return CORRECT if answer == gold else INCORRECT


def answer_line(response: str) -> str | None:
    """The text of the last `Answer:` line within the response's last 300 characters."""
    matches = _ANSWER_LINE.findall(response[-TAIL_CHARS:])
    return matches[-1].strip() if matches else None


def normalise_answer(text: str) -> str:
    """Reduce a final answer to a canonical string.

    Keeps the part after the last `=`, unwraps `\\boxed{}`, `\\textbf{}` and `\\mathrm{}`, then applies the
    shared LaTeX normalisation (`\\text{}`, `$`, spacing, `\\dfrac`/`\\tfrac`, a trailing period, thousands
    separators; see `grading.normalise_latex`).
    """
    s = text.split("=")[-1]
    for command in ("boxed", "textbf", "mathrm"):
        s = re.sub(r"\\" + command + r"\{([^{}]*)\}", r"\1", s)
    return normalise_latex(s)
