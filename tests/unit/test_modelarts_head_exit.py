"""The ModelArts head's exit code for its engine child: what the submitter retries (tasks/submit_modelarts.py reads
task 0's exit code against RETRYABLE_EXIT_CODES)."""

from __future__ import annotations

import signal

import pytest

from tasks.engine_job.messages import LOST, EngineError
from tasks.engine_job.runner import EXIT_CODE_ERROR, EXIT_CONFIG_ERROR, EXIT_INFRASTRUCTURE, EXIT_OK
from tasks.modelarts.entrypoint import RETRYABLE_EXIT_CODES, head_exit_code
from vime_engine.runtime.preemption import PREEMPTED_EXIT_CODE

LOST_ERROR = EngineError(kind=LOST, message="the engine process ended without reporting")


@pytest.mark.parametrize("engine_code, error, head_code", [
    (EXIT_OK, None, EXIT_OK),
    (PREEMPTED_EXIT_CODE, EngineError(kind="preempted", message="Preempted: after rollout 3"), PREEMPTED_EXIT_CODE),
    # Ray ends its driver with exit 1 when the raylet dies: result.json still says the job was lost.
    (1, LOST_ERROR, EXIT_INFRASTRUCTURE),
    (-signal.SIGKILL, LOST_ERROR, EXIT_INFRASTRUCTURE),  # the OOM killer
    (EXIT_INFRASTRUCTURE, EngineError(kind="infrastructure", message="ActorDiedError"), EXIT_INFRASTRUCTURE),
    (EXIT_CODE_ERROR, EngineError(kind="code", message="ZeroDivisionError", traceback="…"), EXIT_CODE_ERROR),
    (EXIT_CONFIG_ERROR, EngineError(kind="config", message="--lr must be > 0"), EXIT_CONFIG_ERROR),
], ids=["done", "preempted", "raylet-died", "killed", "dead-actor", "code-error", "config-error"])
def test_a_lost_engine_is_retried_and_a_code_or_config_error_is_not(engine_code, error, head_code):
    assert head_exit_code(engine_code, error) == head_code
    assert (head_code in RETRYABLE_EXIT_CODES) == (head_code not in (EXIT_OK, EXIT_CODE_ERROR, EXIT_CONFIG_ERROR))
