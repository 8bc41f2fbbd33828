"""Extracting the last `\\boxed{...}` / `\\fbox{...}` answer from a model response."""

from __future__ import annotations

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed_content(text: str) -> str | None:
    """Return the content of the last `\\boxed{...}` or `\\fbox{...}` in `text`, or None.

    Algorithm: find the right-most occurrence of either command, skip optional spaces to its
    opening brace, then scan forward counting `{` / `}` until the depth returns to zero.
    Braces are balanced, so `\\boxed{\\frac{1}{2}}` yields `\\frac{1}{2}`. An unclosed box, or a
    command not followed by `{` (e.g. `\\boxed 5`), yields None for that occurrence and the
    search moves to the previous one.
    """
    end = len(text)
    while True:
        start = max(text.rfind(cmd, 0, end) for cmd in _BOX_COMMANDS)
        if start < 0:
            return None
        content = _braced_group_after(text, start)
        if content is not None:
            return content
        end = start


def _braced_group_after(text: str, command_start: int) -> str | None:
    """The balanced `{...}` group right after the command at `command_start`, without its braces."""
    i = text.find("{", command_start)
    # Only whitespace may sit between the command name and its brace.
    if i < 0 or text[command_start + 1 : i].strip() not in ("boxed", "fbox"):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None
