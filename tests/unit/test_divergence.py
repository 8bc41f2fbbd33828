"""A diverged run stops (vime_engine/checkpoint/finite.py): a non-finite loss or gradient norm ends it naming the
rollout and the metric, a save refuses non-finite tensors and a load reports them, and the pipeline does not retry
a diverged chunk as an infrastructure fault."""

from __future__ import annotations

import math

import pytest
import ray.exceptions as rex
import torch
from prefect.states import Failed
from safetensors.torch import save_file

from tasks.engine_job.messages import EngineError
from tasks.engine_job.process import EngineConfigFailure, failure_for_exit, is_infrastructure_failure
from tasks.engine_job.runner import EXIT_CONFIG_ERROR, exit_code_for
from vime_engine.checkpoint.finite import (
    DivergenceError, NonFiniteCheckpoint, nonfinite_metrics, nonfinite_tensors, stop_if_diverged,
)
from vime_engine.checkpoint.tensor_files import read_tensors, write_tensors
from vime_engine.config import ConfigError

STEP = {"train/pg_loss": 0.12, "train/ppo_kl": 0.0, "train/grad_norm": 0.8, "train/lr": 1e-6}


def test_a_finite_step_goes_on_and_a_non_finite_one_names_the_rollout_and_metric():
    stop_if_diverged(4, STEP)
    for metric, value in (("train/grad_norm", math.nan), ("train/pg_loss", math.inf), ("train/kl_loss", -math.inf)):
        with pytest.raises(DivergenceError) as stopped:
            stop_if_diverged(4, {**STEP, metric: value})
        assert str(stopped.value).startswith(f"rollout 4 diverged: {metric} = {value}; the run stops before saving "
                                             "it, so LATEST stays on the last finite checkpoint; lower --lr")
        assert isinstance(stopped.value, ConfigError) and exit_code_for(stopped.value) == EXIT_CONFIG_ERROR
    assert nonfinite_metrics({**STEP, "train/ppo_kl": math.nan}, ("train/grad_norm",)) == []  # only those watched
    both = {**STEP, "train/pg_loss": math.nan, "train/grad_norm": math.nan}
    assert nonfinite_metrics(both, ("train/pg_loss", "train/grad_norm")) == ["train/pg_loss", "train/grad_norm"]


def test_a_save_refuses_non_finite_tensors_before_writing_and_a_load_reports_them(tmp_path):
    good = {"w": torch.ones(3, 2), "step": torch.tensor(7), "mask": torch.tensor([True, False])}
    write_tensors(tmp_path / "good.safetensors", good)
    poisoned = {**good, "w": torch.tensor([[1.0, math.nan], [0.0, 1.0], [2.0, 3.0]]),
                "b": torch.tensor([math.inf]).to(torch.bfloat16)}
    assert nonfinite_tensors(poisoned) == ["w", "b"]
    # finite values whose sum overflows are finite; a loaded torch_dist state nests its tensors
    nested = {"huge": torch.full((4,), 3e38), "optimizer": {"state": [{"exp_avg": torch.tensor([0.0, math.inf])}]}}
    assert nonfinite_tensors(nested) == ["optimizer.state.0.exp_avg"]
    with pytest.raises(DivergenceError, match=r"x.safetensors: 2 of 4 tensors hold NaN or inf \(w, b\): the run "
                                              r"diverged, so this checkpoint is not saved"):
        write_tensors(tmp_path / "x.safetensors", poisoned)
    assert not (tmp_path / "x.safetensors").exists()
    save_file(poisoned, str(tmp_path / "old.safetensors"))  # as a run saved it before saves refused NaN
    with pytest.raises(NonFiniteCheckpoint, match=r"old.safetensors: 2 tensors hold NaN or inf \(w, b\)"):
        read_tensors(tmp_path / "old.safetensors")
    assert torch.equal(read_tensors(tmp_path / "good.safetensors")["w"], good["w"])


def test_a_diverged_chunk_exits_2_and_is_not_retried():
    in_a_trainer = rex.RayTaskError("save_state", "tb", DivergenceError("rollout_0000002: …")).as_instanceof_cause()
    assert exit_code_for(DivergenceError("rollout 2 diverged")) == exit_code_for(in_a_trainer) == 2
    failure = failure_for_exit(EXIT_CONFIG_ERROR, EngineError(kind="config", message="rollout 2 diverged"))
    assert isinstance(failure, EngineConfigFailure) and "rollout 2 diverged" in str(failure)
    assert is_infrastructure_failure(None, None, Failed(data=failure)) is False
