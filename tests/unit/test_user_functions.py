"""A user's function at the engine's boundary (vime_engine/plugins/boundary.py): a reward, filter, post-process or
advantage function that returns a non-finite number, a non-number or the wrong count, or raises, stops the run with
one message naming the flag, the function, the rollout, the sample and the value (exit 2, a ConfigError)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import ray.exceptions as rex
import torch

from tasks.engine_job.runner import EXIT_CONFIG_ERROR, exit_code_for
from vime_engine.algorithms.advantages import AdvantageInputs
from vime_engine.config import ConfigError, build_config
from vime_engine.plugins.boundary import (
    UserFunctionError, function_name, number_problem, sample_labels, user_functions_in,
)
from vime_engine.rewards import RewardInput
from vime_engine.rewards.custom import load_sample_reward
from vime_engine.rollout.dynamic_sampling import load_group_filter
from vime_engine.sample import Sample
from vime_engine.train.vime_hooks import load_trainer_hooks

FUNCTIONS = '''
import math

calls = []

def nan_reward(response, label):
    return math.nan

def text_reward(response, label):
    return "1.0"

def fifth_call_fails(response, label):
    calls.append(response)
    if len(calls) == 5:
        return 1 / 0
    return 1.0

async def vime_inf(args, sample):
    return math.inf if sample.response == "b" else 0.0

async def vime_raises(args, sample):
    raise KeyError(sample.response)

async def group_scalar(args, samples):
    return 1.0

def says_false(group):
    return "False"

def forgets_to_return(args, samples):
    pass

def post_process_nan(args, samples):
    return [s.reward for s in samples], [0.0, math.nan]

def advantage_nan(args, rollout_data):
    rollout_data["advantages"] = [[0.5] * n for n in rollout_data["response_lengths"]]
    rollout_data["advantages"][1][0] = math.nan
'''


@pytest.fixture
def plugin(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(FUNCTIONS)
    return path


def _group(index: int, responses: list[str]) -> list[Sample]:
    return [Sample(group_index=index, prompt="p", label="l", prompt_tokens=[1], response_tokens=[2, 3],
                   loss_mask=[1, 1], response=r) for r in responses]


def _items(samples: list[Sample]) -> list[RewardInput]:
    return [RewardInput(s.prompt, s.response, s.label, s) for s in samples]


def _stopped(call, where: str = "rollout 3") -> UserFunctionError:
    """The error `call()` raises, placed as the driver places it."""
    with pytest.raises(UserFunctionError) as raised, user_functions_in(where):
        call()
    return raised.value


@pytest.mark.parametrize(("value", "problem"), [
    (1, None), (0.25, None), (True, None), (np.float32(0.5), None), (torch.tensor(2.0), None),
    ("1.0", "returned '1.0' (str), not a number"), (None, "returned None (NoneType), not a number"),
    ([1.0], "returned [1.0] (list), not a number"), (float("nan"), "returned nan, not a finite number"),
    (-float("inf"), "returned -inf, not a finite number"), (np.float64("nan"), "returned nan, not a finite number"),
    (torch.tensor([1.0, 2.0]), "not a single number"),
])
def test_what_counts_as_a_number(value, problem):
    got = number_problem(value)
    assert got == problem if problem is None or got is None else problem in got


@pytest.mark.parametrize(("function", "value"), [("nan_reward", "returned nan, not a finite number"),
                                                 ("text_reward", "returned '1.0' (str), not a number")])
def test_a_reward_that_is_not_a_finite_number_stops_the_run_naming_it(plugin, function, value):
    reward = load_sample_reward(f"{plugin}:{function}", None)
    error = _stopped(lambda: reward(_items(_group(5, ["a", "b"]))))
    assert str(error) == (f"--custom-rm-path {plugin}:{function} {value}; return a finite number as the reward "
                          "(rollout 3, sample 0 of group 5)")
    assert isinstance(error, ConfigError) and exit_code_for(error) == EXIT_CONFIG_ERROR


def test_an_exception_in_a_reward_names_the_call_and_keeps_its_traceback_in_the_log(plugin, capfd):
    reward = load_sample_reward(f"{plugin}:fifth_call_fails", None)
    assert reward(_items(_group(0, ["a", "b", "c", "d"]))) == [1.0] * 4
    error = _stopped(lambda: reward(_items(_group(1, ["e", "f", "g", "h"]))))
    assert str(error) == (f"--custom-rm-path {plugin}:fifth_call_fails raised ZeroDivisionError: division by zero "
                          "(its traceback is in the log); fix the function (rollout 3, sample 0 of group 1)")
    assert isinstance(error.__cause__, ZeroDivisionError)
    log = capfd.readouterr().err  # the process's stderr: the run's log (engine.log, a Ray worker's log)
    assert log.startswith(f"--custom-rm-path {plugin}:fifth_call_fails raised (sample 0 of group 1):\nTraceback")
    assert "return 1 / 0" in log  # the user's line


def test_vime_async_rewards_name_the_sample_of_the_failing_call(plugin):
    samples = _group(2, ["a", "b", "c"])
    inf = _stopped(lambda: load_sample_reward(f"{plugin}:vime_inf", None)(_items(samples)))
    assert "vime_inf returned inf, not a finite number" in str(inf) and "sample 1 of group 2" in str(inf)
    raised = _stopped(lambda: load_sample_reward(f"{plugin}:vime_raises", None)(_items(samples)))
    assert "vime_raises raised KeyError: 'a'" in str(raised) and "sample 0 of group 2" in str(raised)
    scalar = _stopped(lambda: load_sample_reward(f"{plugin}:group_scalar", None, group_rm=True)(_items(samples)))
    assert "group_scalar returned 1.0 (float); return a list of one reward per sample (3)" in str(scalar)
    assert "(rollout 3, group 2)" in str(scalar)


def test_a_filter_whose_answer_would_decide_in_silence_is_refused(plugin, tmp_path):
    for function, returned in (("says_false", "returned 'False'"), ("forgets_to_return", "returned None")):
        keep = load_group_filter(f"{plugin}:{function}", args=None)
        error = _stopped(lambda: keep(_group(7, ["a", "b"])))
        assert f"--dynamic-sampling-filter-path {plugin}:{function} {returned}" in str(error)
        assert str(error).endswith("(rollout 3, group 7)")


def _cfg(tmp_path, **flags):
    return build_config([], **{"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl",
                               "n-samples-per-prompt": 2, "rollout-batch-size": 1, "output-dir": str(tmp_path),
                               **flags})


def test_trainer_hooks_returning_nan_name_the_sample(plugin, tmp_path):
    samples = _group(4, ["a", "b"])
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0]), response_lengths=[2, 2], loss_mask=torch.ones(4),
                             group_size=2, kl=torch.zeros(4))
    log_probs = {"log_probs": None, "ref_log_probs": None, "rollout_log_probs": None}
    for flag, function, named in (
        ("custom-reward-post-process-path", "post_process_nan", "returned nan, not a finite number; return a finite "
                                                                "number as the post-processed reward"),
        ("custom-advantage-function-path", "advantage_nan", "set rollout_data['advantages'] to a value of nan"),
    ):
        cfg = _cfg(tmp_path, **{flag: f"{plugin}:{function}"})
        error = _stopped(lambda: load_trainer_hooks(cfg).advantages(cfg, samples, inputs, log_probs), "rollout 0")
        assert str(error).startswith(f"--{flag} {plugin}:{function} {named}")
        assert str(error).endswith("(rollout 0, sample 1 of group 4)")


def test_the_driver_places_an_error_a_ray_worker_raised_and_keeps_an_earlier_place(capfd):
    inner = UserFunctionError("--custom-rm-path", "m:f", "returned nan", "sample 1 of group 0")
    wrapped = rex.RayTaskError("train", "the worker's traceback", inner).as_instanceof_cause()
    error = _stopped(lambda: (_ for _ in ()).throw(wrapped), "rollout 9")
    assert str(error) == "--custom-rm-path m:f returned nan (rollout 9, sample 1 of group 0)"
    assert "the worker's traceback" in capfd.readouterr().err  # in the run's log, though Ray's forwarding lags
    placed = _stopped(lambda: (_ for _ in ()).throw(inner.at("rollout 2, eval/aime")), "rollout 9")
    assert placed.where == "rollout 2, eval/aime"
    assert str(pickle.loads(pickle.dumps(error))) == str(error)  # as Ray sends it between processes


def test_function_names_and_sample_labels(plugin):
    assert function_name(number_problem) == "vime_engine.plugins.boundary:number_problem"
    keep = load_group_filter(f"{plugin}:forgets_to_return", args=None)  # vime's form: `args` bound by a partial
    assert keep.fn.name == f"{plugin}:forgets_to_return"
    assert sample_labels([3, 3, 4, 3]) == ["sample 0 of group 3", "sample 1 of group 3", "sample 0 of group 4",
                                           "sample 2 of group 3"]
