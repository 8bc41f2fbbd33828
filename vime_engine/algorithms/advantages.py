"""The math of the advantage estimators (vime's `--advantage-estimator` values); `estimators.py` holds their table
and `compute_advantages`, which dispatches through it.

Layout: see `segments.py`. Rewards are per sample [B]; KL, values, loss mask and the returned advantages
are flat token tensors [N]. For group-based estimators the samples are ordered so that every consecutive
run of `group_size` samples answers one prompt.

Where a sample reward is placed on a token, it goes on the sample's last token with loss_mask == 1 (the
last token the policy generated), see `segments.last_trained_token`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vime_engine.algorithms.segments import (
    check_flat,
    expand_to_tokens,
    from_padded,
    last_trained_token,
    reverse_discounted_cumsum,
    to_padded,
)

__all__ = [
    "AdvantageInputs",
    "AdvantageResult",
    "expand_to_tokens",
    "gae_advantages",
    "group_normalized_advantages",
    "masked_whiten",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
]


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(values - mean) / sqrt(var + eps) with mean and variance taken over the elements where mask > 0.

    The variance is the biased (population) one: sum((v - mean)^2 * m) / sum(m). Positions with mask == 0
    come back as 0, so nothing outside the mask can leak into a loss. An all-zero mask returns zeros.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have one shape")
    weights = (mask > 0).to(values.dtype)
    count = weights.sum()
    if count == 0:
        return torch.zeros_like(values)
    mean = (values * weights).sum() / count
    var = (((values - mean) ** 2) * weights).sum() / count
    return (values - mean) * torch.rsqrt(var + eps) * weights


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """[B] -> [B / group_size, group_size]; ValueError when the batch is not whole groups."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} samples, "
            f"got shape {tuple(rewards.shape)}"
        )
    return rewards.view(-1, group_size)


def group_normalized_advantages(
    rewards: Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO (and GSPO) per-sample advantage: (r - group mean) / (group std + eps).

    The std is the unbiased one (Bessel's correction, divides by group_size - 1), as torch.std computes
    it by default. A group of one sample has advantage 0. `normalize_std=False`
    (`--disable-grpo-std-normalization`) returns r - group mean (Dr. GRPO). A group whose rewards are
    all equal has advantage 0 either way. Returns [B] in the input order.
    """
    groups = _grouped(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def _reward_on_last_token(rewards: Tensor, response_lengths: Sequence[int], loss_mask: Tensor,
                          dtype: torch.dtype) -> Tensor:
    """Flat [N] tensor that is 0 except for each sample's reward on its last trained token."""
    if rewards.dim() != 1 or rewards.numel() != len(response_lengths):
        raise ValueError(f"rewards must have one value per sample ({len(response_lengths)})")
    last = last_trained_token(response_lengths, loss_mask)
    has_tokens = last >= 0
    placed = torch.zeros(loss_mask.numel(), dtype=dtype, device=loss_mask.device)
    return placed.index_add(0, last[has_tokens], rewards[has_tokens].to(dtype))


def reinforce_plus_plus_advantages(
    rewards: Tensor,
    kl: Tensor,
    response_lengths: Sequence[int],
    loss_mask: Tensor,
    kl_coef: float,
    gamma: float = 1.0,
) -> Tensor:
    """REINFORCE++: whitened discounted return-to-go of a KL-shaped token reward.

    Token reward r_t = -kl_coef * kl_t on trained tokens (mask 1), plus the sample reward on the last
    trained token. Return G_t = r_t + gamma * G_{t+1} within each sample (G after the last token = 0).
    The returns are then whitened over all trained tokens of the batch (`masked_whiten`), so the result
    has mean 0 and variance 1 over the mask and is 0 off the mask. Returns [N].
    """
    check_flat(kl, response_lengths, "kl")
    kl_penalty = -kl_coef * kl * (loss_mask > 0).to(kl.dtype)
    token_rewards = kl_penalty + _reward_on_last_token(rewards, response_lengths, loss_mask, kl.dtype)
    padded = to_padded(token_rewards, response_lengths)
    returns = from_padded(reverse_discounted_cumsum(padded, gamma), response_lengths)
    return masked_whiten(returns, loss_mask)


def reinforce_plus_plus_baseline_advantages(
    rewards: Tensor,
    kl: Tensor,
    response_lengths: Sequence[int],
    loss_mask: Tensor,
    group_size: int,
    kl_coef: float,
    centre: bool = True,
) -> Tensor:
    """REINFORCE++ with a group baseline: A_t = (r_i - mean of r over i's group) - kl_coef * kl_t.

    The centred sample reward is broadcast to every token of the sample, the KL penalty is subtracted
    per token (on trained tokens only), and the result is whitened over the trained tokens of the batch.
    `centre=False`: the rewards come centred already (a reward post-process), r_i is used as it is.
    Returns [N].
    """
    check_flat(kl, response_lengths, "kl")
    groups = _grouped(rewards, group_size)
    centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1) if centre else rewards
    per_token = expand_to_tokens(centred.to(kl.dtype), response_lengths)
    per_token = per_token - kl_coef * kl * (loss_mask > 0).to(kl.dtype)
    return masked_whiten(per_token, loss_mask)


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    response_lengths: Sequence[int],
    loss_mask: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """PPO's generalised advantage estimation with a critic; the sample reward on its last trained token.

    delta_t = r_t + gamma * V_{t+1} - V_t with V after the sample's final token = 0, and
    A_t = delta_t + gamma * lam * A_{t+1}; returns R_t = A_t + V_t (the critic's target). Advantages are
    not whitened here (`compute_advantages(normalize_advantages=True)` does that). Returns ([N], [N]).
    """
    check_flat(values, response_lengths, "values")
    token_rewards = _reward_on_last_token(rewards, response_lengths, loss_mask, values.dtype)
    padded_values = to_padded(values, response_lengths)
    next_values = torch.zeros_like(padded_values)
    next_values[:, :-1] = padded_values[:, 1:]  # padding is 0, so V after the final token is 0
    deltas = to_padded(token_rewards, response_lengths) + gamma * next_values - padded_values
    advantages = from_padded(reverse_discounted_cumsum(deltas, gamma * lam), response_lengths)
    return advantages, advantages + values


@dataclass(frozen=True)
class AdvantageInputs:
    """What the estimators read from a rollout batch (flat token layout, see `segments.py`)."""

    rewards: Tensor  # [B]
    response_lengths: Sequence[int]  # B ints, sum == N
    loss_mask: Tensor  # [N], 1 = token trained
    group_size: int  # --n-samples-per-prompt
    kl: Tensor | None = None  # [N] per-token KL to the reference; read where EstimatorSpec.uses_reward_kl
    values: Tensor | None = None  # [N] critic values; read where EstimatorSpec.needs_critic


@dataclass(frozen=True)
class AdvantageResult:
    advantages: Tensor  # [N]
    returns: Tensor | None = None  # [N], the critic's target; only where EstimatorSpec.needs_critic
