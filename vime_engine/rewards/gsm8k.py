"""`--rm-type gsm8k`: the final number of the response against the numeric label."""

from __future__ import annotations

import re
from fractions import Fraction

# A number as people write it: optional sign, `$`, thousands separators, decimals. The sign
# counts only when it does not follow a word or a digit, so `10-4` yields 10 and 4, not -4.
_NUMBER = re.compile(r"(?:(?<![\w.)])-)?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_FINAL_LINE = re.compile(r"^\s*####\s*(.+?)\s*$", re.MULTILINE)


def gsm8k_reward(response: str, label: str) -> float:
    """1.0 if the response's final number equals the label's number, else 0.0.

    The label is a number, or a raw gsm8k `answer` whose `#### N` line gives the number. The
    response's answer is its last `#### N` line if it has one, otherwise the last number
    anywhere in it (so "2 + 3 = 5." gives 5). Numbers compare by exact value after dropping
    `$` and thousands separators: `3.0` equals `3`, `1,000` equals `1000`.
    """
    gold = final_number(label)
    if gold is None:
        raise ValueError(f"gsm8k reward: the label {label!r} holds no number")
    answer = final_number(response)
    return 1.0 if answer is not None and answer == gold else 0.0


def final_number(text: str) -> Fraction | None:
    """The value of the last `#### N` line's number, else of the last number in `text`."""
    final_lines = _FINAL_LINE.findall(text)
    if final_lines:
        text = final_lines[-1]
    numbers = list(_NUMBER.finditer(text))
    if not numbers:
        return None
    return _value(numbers[-1])


def _value(match: re.Match[str]) -> Fraction:
    return Fraction(match.group(0).replace("$", "").replace(",", ""))
