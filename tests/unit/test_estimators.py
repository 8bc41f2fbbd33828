"""The estimators' table (vime_engine/algorithms/estimators.py) is the one place an estimator is declared: the config's
checks, the trainers and compute_advantages read its spec. The math fields' marks live on the fields
(vime_engine/config/sections.py)."""

from __future__ import annotations

import pytest
import torch

from vime_engine.algorithms.advantages import AdvantageInputs, AdvantageResult
from vime_engine.algorithms.estimators import ESTIMATORS, AdvantageSettings, EstimatorSpec, compute_advantages
from vime_engine.config import NON_MATH_FIELDS, ConfigError, LoggingConfig, from_flat
from vime_engine.train.objective import needs_reference
from vime_engine.train.vime_hooks import vime_default_rewards

REQUIRED = {"hf-checkpoint": "/models/m", "prompt-data": "/data/p.jsonl"}


def _ones(inputs: AdvantageInputs, settings: AdvantageSettings) -> AdvantageResult:
    return AdvantageResult(torch.full_like(inputs.loss_mask, settings.kl_coef))


def test_an_estimator_is_one_entry_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ESTIMATORS, "fake", EstimatorSpec(_ones, group_baseline=True, uses_reward_kl=True))
    with pytest.raises(ConfigError, match="--advantage-estimator fake compares samples.*--n-samples-per-prompt"):
        from_flat({**REQUIRED, "advantage-estimator": "fake", "n-samples-per-prompt": 1, "rollout-batch-size": 4})
    cfg = from_flat({**REQUIRED, "advantage-estimator": "fake", "kl-coef": 0.5})
    assert needs_reference(cfg)
    # a group baseline without the std: centred rewards for vime's advantage function
    assert vime_default_rewards(cfg, torch.tensor([1.0, 3.0]), 2).tolist() == [-1.0, 1.0]
    inputs = AdvantageInputs(rewards=torch.tensor([1.0]), response_lengths=[2], loss_mask=torch.ones(2),
                             group_size=1, kl=torch.zeros(2))
    assert compute_advantages("fake", inputs, kl_coef=0.5).advantages.tolist() == [0.5, 0.5]
    # the estimators without a reward KL name the new one as the way to use --kl-coef
    with pytest.raises(ConfigError, match="--advantage-estimator reinforce_plus_plus or .* or fake"):
        from_flat({**REQUIRED, "kl-coef": 0.1})


def test_an_unknown_estimator_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError) as refused:
        from_flat({**REQUIRED, "advantage-estimator": "dapo"})
    assert "--advantage-estimator 'dapo'" in str(refused.value)
    assert all(name in str(refused.value) for name in ESTIMATORS)


def test_std_normalisation_needs_a_group_baseline() -> None:
    with pytest.raises(ValueError, match="needs group_baseline"):
        EstimatorSpec(_ones, std_normalized=True)


def test_non_math_fields_are_marked_where_declared() -> None:
    assert set(LoggingConfig.model_fields) <= NON_MATH_FIELDS  # the whole section, by its mark
    assert {"hf_checkpoint", "num_rollout", "save", "colocate", "eval_top_p"} <= NON_MATH_FIELDS
    assert not {"lr", "advantage_estimator", "n_samples_per_prompt", "seed", "device"} & NON_MATH_FIELDS
    cfg = from_flat(REQUIRED)
    assert not NON_MATH_FIELDS & set(cfg.math_fields())
