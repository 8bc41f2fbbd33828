"""ConfigError, and how its messages name a field: by the flag a user types."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flag and the fix."""


class RunStoppedError(ConfigError):
    """Input the user can fix, found only once the run trains (a user function's value, a diverged step): exit 2
    like any ConfigError, but what the run wrote until then (its logs, metrics and checkpoints) stays."""


def flag_name(field: str) -> str:
    """The flag of a field: `rollout_batch_size` → `--rollout-batch-size`."""
    return "--" + field.replace("_", "-")
