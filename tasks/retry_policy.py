"""Which failures a Prefect task retries: only those another attempt can fix.

A task names the exception types that mean "try again" (a transient storage error, an engine process lost
to its infrastructure); anything else (a missing object, a refused credential, a bad configuration, a bug)
fails the task on its first attempt, with the error itself as the task's and the flow's exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RetryCondition = Callable[[Any, Any, Any], bool]


def retry_on(*retryable: type[BaseException]) -> RetryCondition:
    """A Prefect ``retry_condition_fn`` that retries a failed attempt only when it raised one of ``retryable``."""

    def condition(task, task_run, state) -> bool:
        try:
            state.result()
        except retryable:
            return True
        except Exception:  # noqa: BLE001  (every other failure is final)
            return False
        return False

    condition.__name__ = "retry_on_" + "_or_".join(t.__name__ for t in retryable)
    return condition
