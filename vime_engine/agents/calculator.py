"""The calculator tool: `<tool_call>EXPRESSION</tool_call>` found in a model's turn, evaluated without `eval`.

The expression is parsed with `ast` and only numbers, parentheses, unary +/- and + - * / // % ** are walked;
anything else (names, calls, attributes, strings) is refused with a message the model reads as the tool's reply.
Sizes are bounded so a reply stays cheap: at most `MAX_EXPRESSION_CHARS` characters, exponents up to
`MAX_EXPONENT`, results up to `MAX_MAGNITUDE` in absolute value.
"""

from __future__ import annotations

import ast
import math
import operator
import re

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**18
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is what the model is told."""


def find_tool_call(text: str) -> str | None:
    """The expression of the first complete `<tool_call>…</tool_call>` in `text`, stripped; None if there is none."""
    match = TOOL_CALL.search(text)
    return None if match is None else match.group(1).strip()


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression; CalculatorError for anything else, or too large, or undefined."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def reply(expression: str) -> str:
    """The tool's answer as the model reads it: the value (integers without a decimal point), or `error: …`."""
    try:
        value = calculate(expression)
    except CalculatorError as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except (OverflowError, ValueError) as exc:  # e.g. a negative number to a fractional power
            raise CalculatorError(str(exc)) from None
    raise CalculatorError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")


def _bounded(value: int | float | complex) -> int | float:
    if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
        raise CalculatorError("the result is not a real number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"the result is larger than {MAX_MAGNITUDE:.0e}")
    return value
