"""Loading a user's reward function from `--custom-rm-path`."""

from __future__ import annotations

from collections.abc import Callable

from vime_engine.plugins import load_function

RewardFn = Callable[[str, str], float]


def load_custom_reward(spec: str) -> RewardFn:
    """The function named by `spec`, checked to be callable as `fn(response, label)` (see `load_function`)."""
    return load_function(spec, "--custom-rm-path", ("response", "label"), "`(response: str, label: str) -> float`")
