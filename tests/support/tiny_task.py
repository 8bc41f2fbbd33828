"""The tiny model's task for tests (`--custom-rm-path tests/support/tiny_task.py:digit_share`): the engine's
own digit-share reward, which the tiny pipeline config names as `vime_engine.rewards.digit_share:digit_share`."""

from vime_engine.rewards.digit_share import digit_share

__all__ = ["digit_share"]
