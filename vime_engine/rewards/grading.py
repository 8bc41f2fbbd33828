"""Deciding whether a final math answer equals the gold answer.

The grader is math-verify (parse both sides, then `verify(gold, answer)`, gold first as its
API requires). When math-verify cannot parse one side, a small sympy check decides plain
numeric expressions (integers, decimals, fractions, `\\frac`, `\\sqrt`, `\\pi`), and as a last
resort the normalised strings are compared.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # both are imported where an answer is graded: the driver imports the rewards only to check
    import sympy   # the labels, and its start-up would wait 0.3 s for them (bench/startup.py)

# math-verify logs every unparsable answer at WARNING; during RL most responses are unparsable.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# math-verify's timeouts use SIGALRM, which Python only allows in the main thread; rewards are
# also computed from worker threads (Ray actors, thread pools), where we run without a timeout.
_TIMEOUT_SECONDS = 5

# The sympy fallback evaluates the expression, so it accepts only arithmetic on numbers: no
# names beyond these, no powers (a response such as `9^9^9` must not hang the reward).
_ALLOWED_NAMES = ("sqrt", "pi")
_NUMERIC_EXPRESSION = re.compile(r"^[0-9+\-*/().]+$")
_MAX_FALLBACK_LENGTH = 200


def answers_match(answer: str, gold: str) -> bool:
    """True when `answer` (a final answer, e.g. the content of a `\\boxed{}`) equals `gold`.

    Order of checks: math-verify on both; if either side does not parse, sympy on both (only
    for plain numeric expressions); if that is not possible either, exact equality of the
    normalised strings.
    """
    gold_parsed = _math_verify_parse(gold)
    answer_parsed = _math_verify_parse(answer)
    if _has_expression(gold_parsed) and _has_expression(answer_parsed):
        return _math_verify_equal(gold_parsed, answer_parsed)
    gold_value = _sympy_value(gold)
    answer_value = _sympy_value(answer)
    if gold_value is not None and answer_value is not None:
        import sympy

        return bool(sympy.simplify(gold_value - answer_value) == 0)
    return normalise_latex(answer) == normalise_latex(gold)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _math_verify_parse(text: str) -> list:
    # Wrapping in \boxed{} makes math-verify read bare LaTeX such as `\frac{1}{2}`, which it
    # would otherwise only look for between math delimiters.
    import math_verify

    timeout = _TIMEOUT_SECONDS if _in_main_thread() else None
    try:
        return math_verify.parse("\\boxed{" + text + "}", parsing_timeout=timeout)
    except Exception:  # math-verify raises assorted errors (and TimeoutError) on odd input
        return []


def _has_expression(parsed: list) -> bool:
    # math-verify returns the raw string alone when it could not build an expression.
    return any(not isinstance(item, str) for item in parsed)


def _math_verify_equal(gold_parsed: list, answer_parsed: list) -> bool:
    import math_verify

    timeout = _TIMEOUT_SECONDS if _in_main_thread() else None
    try:
        return bool(math_verify.verify(gold_parsed, answer_parsed, timeout_seconds=timeout))
    except Exception:
        return False


def normalise_latex(text: str) -> str:
    """Strip the LaTeX decoration that does not change a value: `$`, spacing, `\\left`/`\\right`,
    `\\dfrac`/`\\tfrac`, `\\text{}`, a trailing period, thousands separators."""
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", "$"):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _to_python_arithmetic(latex: str) -> str:
    """Rewrite the numeric LaTeX subset into Python syntax: `\\frac{a}{b}` → `(a)/(b)`,
    `\\sqrt{a}` → `sqrt(a)`, `\\cdot`/`\\times` → `*`, `\\pi` → `pi`, remaining braces → parens."""
    s = normalise_latex(latex)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\pi", "pi")
    # Innermost first, so nested fractions unwind one level per pass.
    frac = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
    sqrt = re.compile(r"\\sqrt\{([^{}]*)\}")
    while True:
        rewritten = sqrt.sub(r"sqrt(\1)", frac.sub(r"(\1)/(\2)", s))
        if rewritten == s:
            break
        s = rewritten
    return s.replace("{", "(").replace("}", ")")


def _sympy_value(text: str) -> sympy.Expr | None:
    """The exact sympy value of a plain numeric expression, or None if `text` is not one."""
    import sympy

    expr = _to_python_arithmetic(text)
    if not expr or len(expr) > _MAX_FALLBACK_LENGTH or "**" in expr:
        return None
    stripped = expr
    for name in _ALLOWED_NAMES:
        stripped = stripped.replace(name, "")
    if not _NUMERIC_EXPRESSION.match(stripped):
        return None
    try:
        value = sympy.sympify(expr, rational=True)
    except (sympy.SympifyError, SyntaxError, TypeError, ZeroDivisionError):
        return None
    return value if isinstance(value, sympy.Expr) and value.is_number else None
