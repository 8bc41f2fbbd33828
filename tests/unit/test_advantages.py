"""Advantage estimators against numbers worked out by hand (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from vime_engine.algorithms.advantages import (
    AdvantageInputs,
    expand_to_tokens,
    gae_advantages,
    group_normalized_advantages,
    masked_whiten,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
)
from vime_engine.algorithms.estimators import ESTIMATORS, compute_advantages
from vime_engine.algorithms.segments import last_trained_token


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def assert_close(actual: torch.Tensor, expected: list[float], atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# --- GRPO -------------------------------------------------------------------------------------------


def test_grpo_uses_the_unbiased_group_std() -> None:
    # group 1: [1, 0, 0, 0], mean 0.25, deviations [0.75, -0.25, -0.25, -0.25]
    #   unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25 -> std 0.5 -> [1.5, -0.5, -0.5, -0.5]
    #   (the biased std sqrt(0.1875) = 0.433 would give 1.732 instead)
    # group 2: all rewards equal -> deviations 0 -> advantages 0
    adv = group_normalized_advantages(t(1, 0, 0, 0, 1, 1, 1, 1), group_size=4)
    assert_close(adv, [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], atol=1e-5)


def test_grpo_std_eps_is_added_to_the_std() -> None:
    # [1, 0]: deviations ±0.5, unbiased std sqrt(0.5) = 0.70711; eps = 0.29289 makes the denominator 1.0
    adv = group_normalized_advantages(t(1, 0), group_size=2, eps=1 - math.sqrt(0.5))
    assert_close(adv, [0.5, -0.5])


def test_grpo_without_std_normalization_only_centres() -> None:
    # --disable-grpo-std-normalization: group means 0.25 and 2.0
    adv = group_normalized_advantages(t(1, 0, 0, 0, 3, 1, 2, 2), group_size=4, normalize_std=False)
    assert_close(adv, [0.75, -0.25, -0.25, -0.25, 1.0, -1.0, 0.0, 0.0])


def test_grpo_group_of_one_has_zero_advantage() -> None:
    assert_close(group_normalized_advantages(t(3, -1), group_size=1), [0.0, 0.0])


@pytest.mark.parametrize("group_size", [0, 3])
def test_grpo_rejects_a_batch_that_is_not_whole_groups(group_size: int) -> None:
    with pytest.raises(ValueError, match="group_size"):
        group_normalized_advantages(t(1, 0, 1, 0), group_size=group_size)


# --- whitening and helpers ---------------------------------------------------------------------------


def test_masked_whiten_uses_only_masked_values_and_zeroes_the_rest() -> None:
    # masked values [1, 2, 3]: mean 2, biased var (1 + 0 + 1) / 3 = 2/3, std 0.816497
    # -> [-1.224745, 0, 1.224745]; the unmasked 100 is ignored and comes back 0
    out = masked_whiten(t(1, 2, 3, 100), t(1, 1, 1, 0))
    assert_close(out, [-1 / math.sqrt(2 / 3), 0, 1 / math.sqrt(2 / 3), 0])


def test_masked_whiten_with_an_empty_mask_is_zero() -> None:
    assert_close(masked_whiten(t(1, 2), t(0, 0)), [0.0, 0.0])


def test_expand_to_tokens_repeats_per_sample_values() -> None:
    assert_close(expand_to_tokens(t(3, 5, 7), [2, 0, 1]), [3, 3, 7])
    with pytest.raises(ValueError, match="one value per sample"):
        expand_to_tokens(t(3, 5), [2, 0, 1])


def test_reward_goes_on_the_last_trained_token() -> None:
    # sample 0 (flat 0..2): last mask-1 token is flat 1; sample 1 (flat 3..4): nothing trained -> its
    # final token, flat 4; sample 2: no tokens -> -1; sample 3 (flat 5): flat 5
    last = last_trained_token([3, 2, 0, 1], t(1, 1, 0, 0, 0, 1))
    assert last.tolist() == [1, 4, -1, 5]


# --- REINFORCE++ ------------------------------------------------------------------------------------


def test_reinforce_plus_plus_return_to_go_then_whitened() -> None:
    # kl_coef 0.5, gamma 1; sample 0 (reward 1) kl [0.2, 0.4], sample 1 (reward 0) kl [0.2, 0, 0.2]
    # token rewards: s0 [-0.1, -0.2 + 1] = [-0.1, 0.8]; s1 [-0.1, 0, -0.1]
    # returns-to-go: s0 [0.7, 0.8]; s1 [-0.2, -0.1, -0.1]
    # mean 1.1 / 5 = 0.22; deviations [0.48, 0.58, -0.42, -0.32, -0.32]
    # var (0.2304 + 0.3364 + 0.1764 + 0.1024 + 0.1024) / 5 = 0.1896
    adv = reinforce_plus_plus_advantages(
        t(1, 0), t(0.2, 0.4, 0.2, 0.0, 0.2), [2, 3], t(1, 1, 1, 1, 1), kl_coef=0.5
    )
    std = math.sqrt(0.1896)
    assert_close(adv, [0.48 / std, 0.58 / std, -0.42 / std, -0.32 / std, -0.32 / std])


def test_reinforce_plus_plus_discounts_with_gamma() -> None:
    # same token rewards, gamma 0.5: s0 [-0.1 + 0.5 * 0.8, 0.8] = [0.3, 0.8]
    # s1: G2 = -0.1, G1 = 0 + 0.5 * -0.1 = -0.05, G0 = -0.1 + 0.5 * -0.05 = -0.125
    # mean 0.825 / 5 = 0.165; deviations [0.135, 0.635, -0.29, -0.215, -0.265]
    # var (0.018225 + 0.403225 + 0.0841 + 0.046225 + 0.070225) / 5 = 0.1244
    adv = reinforce_plus_plus_advantages(
        t(1, 0), t(0.2, 0.4, 0.2, 0.0, 0.2), [2, 3], t(1, 1, 1, 1, 1), kl_coef=0.5, gamma=0.5
    )
    std = math.sqrt(0.1244)
    assert_close(adv, [0.135 / std, 0.635 / std, -0.29 / std, -0.215 / std, -0.265 / std])


def test_reinforce_plus_plus_ignores_untrained_tokens() -> None:
    # sample 0 has a trailing untrained token (flat 2) with a large kl that must not count;
    # its reward 2 lands on flat 1. token rewards s0 [0, 2, 0], s1 [0, 0]; returns s0 [2, 2, 0], s1 [0, 0]
    # whiten over flat {0, 1, 3, 4}: values [2, 2, 0, 0], mean 1, var 1 -> [1, 1, -1, -1]; flat 2 -> 0
    adv = reinforce_plus_plus_advantages(
        t(2, 0), t(0, 0, 5, 0, 0), [3, 2], t(1, 1, 0, 1, 1), kl_coef=1.0
    )
    assert_close(adv, [1, 1, 0, -1, -1], atol=1e-6)


def test_reinforce_plus_plus_baseline_centres_per_group_and_subtracts_kl() -> None:
    # groups of 2: rewards [1, 0 | 0.5, 0.5] -> centred [0.5, -0.5 | 0, 0]
    # lengths [1, 2, 1, 1] -> tokens [0.5, -0.5, -0.5, 0, 0]
    # minus 0.5 * kl [0.2, 0, 0.4, 0.2, 0] = [0.1, 0, 0.2, 0.1, 0] -> [0.4, -0.5, -0.7, -0.1, 0]
    # mean -0.9 / 5 = -0.18; deviations [0.58, -0.32, -0.52, 0.08, 0.18]
    # var (0.3364 + 0.1024 + 0.2704 + 0.0064 + 0.0324) / 5 = 0.1496
    adv = reinforce_plus_plus_baseline_advantages(
        t(1, 0, 0.5, 0.5), t(0.2, 0, 0.4, 0.2, 0), [1, 2, 1, 1], t(1, 1, 1, 1, 1), group_size=2, kl_coef=0.5
    )
    std = math.sqrt(0.1496)
    assert_close(adv, [0.58 / std, -0.32 / std, -0.52 / std, 0.08 / std, 0.18 / std])


# --- PPO / GAE --------------------------------------------------------------------------------------


def test_gae_with_gamma_and_lambda() -> None:
    # gamma 0.9, lam 0.5. sample 0: reward 1, values [0.5, 0.25]
    #   t1: delta = 1 + 0.9 * 0 - 0.25 = 0.75; A1 = 0.75
    #   t0: delta = 0 + 0.9 * 0.25 - 0.5 = -0.275; A0 = -0.275 + 0.45 * 0.75 = 0.0625
    #   returns = A + V = [0.5625, 1.0]
    # sample 1: reward 2, value [1.0]: delta = 2 - 1 = 1; A = 1; return 2
    adv, ret = gae_advantages(t(1, 2), t(0.5, 0.25, 1.0), [2, 1], t(1, 1, 1), gamma=0.9, lam=0.5)
    assert_close(adv, [0.0625, 0.75, 1.0])
    assert_close(ret, [0.5625, 1.0, 2.0])


def test_gae_with_lambda_one_is_monte_carlo() -> None:
    # gamma = lam = 1: A_t = R - V_t, returns = R everywhere: [1 - 0.5, 1 - 0.25], [2 - 1]
    adv, ret = gae_advantages(t(1, 2), t(0.5, 0.25, 1.0), [2, 1], t(1, 1, 1), gamma=1.0, lam=1.0)
    assert_close(adv, [0.5, 0.75, 1.0])
    assert_close(ret, [1.0, 1.0, 2.0])


def test_gae_reward_lands_on_the_last_trained_token() -> None:
    # mask [1, 0]: reward 1 on t0, values 0, gamma = lam = 1 -> A = [1, 0]
    adv, _ = gae_advantages(t(1), t(0, 0), [2], t(1, 0), gamma=1.0, lam=1.0)
    assert_close(adv, [1.0, 0.0])


# --- dispatch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_compute_advantages_group_estimators_broadcast_to_tokens(estimator: str) -> None:
    # rewards [1, 0] in one group: ±0.5 / sqrt(0.5) = ±0.707107, over lengths [2, 1]
    inputs = AdvantageInputs(rewards=t(1, 0), response_lengths=[2, 1], loss_mask=t(1, 1, 1), group_size=2)
    result = compute_advantages(estimator, inputs)
    assert_close(result.advantages, [0.707107, 0.707107, -0.707107], atol=1e-5)
    assert result.returns is None


def test_compute_advantages_normalize_advantages_whitens_tokens() -> None:
    # tokens [a, a, -a] with a = 0.707: mean a/3, deviations [2a/3, 2a/3, -4a/3],
    # var (4 + 4 + 16) / 9 * a^2 / 3 = 8/9 a^2 -> [2, 2, -4] / sqrt(8) = [0.7071, 0.7071, -1.4142]
    inputs = AdvantageInputs(rewards=t(1, 0), response_lengths=[2, 1], loss_mask=t(1, 1, 1), group_size=2)
    result = compute_advantages("grpo", inputs, normalize_advantages=True)
    assert_close(result.advantages, [2 / math.sqrt(8), 2 / math.sqrt(8), -4 / math.sqrt(8)], atol=1e-5)


def test_compute_advantages_reinforce_estimators_read_kl() -> None:
    # the hand-worked cases above, through the dispatcher
    inputs = AdvantageInputs(rewards=t(2, 0), response_lengths=[3, 2], loss_mask=t(1, 1, 0, 1, 1),
                             group_size=1, kl=t(0, 0, 5, 0, 0))
    result = compute_advantages("reinforce_plus_plus", inputs, kl_coef=1.0)
    assert_close(result.advantages, [1, 1, 0, -1, -1])
    # baseline with groups of 2 (the rewards' mean 1 is subtracted): centred [1, -1] -> tokens
    # [1, 1, 1, -1, -1] (flat 2 is untrained, kl ignored); mean over mask 0, var 1 -> same values, flat 2 -> 0
    inputs = AdvantageInputs(rewards=t(2, 0), response_lengths=[3, 2], loss_mask=t(1, 1, 0, 1, 1),
                             group_size=2, kl=t(0, 0, 5, 0, 0))
    result = compute_advantages("reinforce_plus_plus_baseline", inputs, kl_coef=1.0)
    assert_close(result.advantages, [1, 1, 0, -1, -1])


def test_compute_advantages_ppo_returns_returns() -> None:
    inputs = AdvantageInputs(rewards=t(1, 2), response_lengths=[2, 1], loss_mask=t(1, 1, 1),
                             group_size=1, values=t(0.5, 0.25, 1.0))
    result = compute_advantages("ppo", inputs, gamma=0.9, lam=0.5)
    assert_close(result.advantages, [0.0625, 0.75, 1.0])
    assert result.returns is not None
    assert_close(result.returns, [0.5625, 1.0, 2.0])


def test_compute_advantages_rejects_missing_inputs_and_unknown_names() -> None:
    inputs = AdvantageInputs(rewards=t(1, 0), response_lengths=[1, 1], loss_mask=t(1, 1), group_size=2)
    with pytest.raises(ValueError, match="needs per-token kl"):
        compute_advantages("reinforce_plus_plus", inputs)
    with pytest.raises(ValueError, match="needs per-token values"):
        compute_advantages("ppo", inputs)
    with pytest.raises(ValueError, match="unknown --advantage-estimator 'dapo'"):
        compute_advantages("dapo", inputs)
    assert set(ESTIMATORS) == {"grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"}


def test_flat_tensors_must_match_the_response_lengths() -> None:
    with pytest.raises(ValueError, match="sum\\(response_lengths\\)=3"):
        reinforce_plus_plus_advantages(t(1, 0), t(0, 0), [2, 1], t(1, 1), kl_coef=0.1)
