"""The words a switch takes for true and false: on the command line, in YAML, in Megatron pass-through flags."""

from __future__ import annotations

from typing import Any

TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def switch_value(value: Any) -> bool | None:
    """A bool as itself, a word for one (`yes`, `Off`, `1` …) as its bool; None for anything else."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    return None
