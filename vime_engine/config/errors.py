"""ConfigError, and how its messages name a field: by the flag a user types."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the flag and the fix."""


def flag_name(field: str) -> str:
    """The flag of a field: `rollout_batch_size` → `--rollout-batch-size`."""
    return "--" + field.replace("_", "-")
