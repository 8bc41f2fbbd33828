"""The advantage estimators in one table (`--advantage-estimator`): what each needs from the rest of the engine,
and `compute_advantages`, which dispatches through it. The math is in `advantages.py`.

An estimator is one entry in ESTIMATORS: the config's checks (vime_engine/config/checks.py), the trainers
(vime_engine/train/objective.py, torch_backend.py, megatron_backend.py, rollout_batch.py) and vime's hooks
(vime_engine/train/vime_hooks.py) read its spec, never its name.

The module imports no torch: vime_engine/config/ reads the table in processes that never load it (the CLI refuses
a bad flag in half a second, torch alone takes two), so the math is imported by the functions that run it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vime_engine.algorithms.advantages import AdvantageInputs, AdvantageResult

__all__ = ["ESTIMATORS", "AdvantageSettings", "EstimatorSpec", "compute_advantages"]


@dataclass(frozen=True)
class AdvantageSettings:
    """The flags an estimator reads besides the batch, as `compute_advantages` resolves them."""

    normalize_std: bool  # spec.std_normalized and not --disable-grpo-std-normalization
    kl_coef: float  # --kl-coef
    gamma: float  # --gamma
    lam: float  # --lambd
    rewards_normalized: bool  # a reward post-process normalised the rewards in their groups already


@dataclass(frozen=True)
class EstimatorSpec:
    """What one estimator needs. Invariant: `std_normalized` only with `group_baseline`.

    advantages: the token-level advantages [N] before `--normalize-advantages`; called with `inputs.kl` set when
        `uses_reward_kl` and `inputs.values` set when `needs_critic`.
    group_baseline: compares the samples of one prompt with their mean, so a prompt needs `--n-samples-per-prompt`
        >= 2; the rewards vime hands a custom advantage function are centred in their groups.
    std_normalized: that baseline is divided by the group's std too (unless `--disable-grpo-std-normalization`).
    uses_reward_kl: folds `--kl-coef` × the per-token KL to the reference model into the reward (reads `inputs.kl`);
        the other estimators refuse `--kl-coef`.
    needs_critic: trains a value head beside the policy (reads `inputs.values`, returns the critic's targets).
    sequence_level_loss: trained with the sequence-level policy loss (`losses.gspo_policy_loss`), not the per-token one.
    """

    advantages: Callable[[AdvantageInputs, AdvantageSettings], AdvantageResult]
    group_baseline: bool = False
    std_normalized: bool = False
    uses_reward_kl: bool = False
    needs_critic: bool = False
    sequence_level_loss: bool = False

    def __post_init__(self) -> None:
        if self.std_normalized and not self.group_baseline:
            raise ValueError("EstimatorSpec: std_normalized divides the group baseline, so it needs group_baseline")


def _group_normalized(inputs: AdvantageInputs, settings: AdvantageSettings) -> AdvantageResult:
    """The group-normalised sample advantage on every token of the sample; rewards normalised already as they are."""
    from vime_engine.algorithms.advantages import AdvantageResult, expand_to_tokens, group_normalized_advantages

    per_sample = (inputs.rewards if settings.rewards_normalized
                  else group_normalized_advantages(inputs.rewards, inputs.group_size, settings.normalize_std))
    return AdvantageResult(expand_to_tokens(per_sample, inputs.response_lengths))


def _reinforce_plus_plus(inputs: AdvantageInputs, settings: AdvantageSettings) -> AdvantageResult:
    from vime_engine.algorithms.advantages import AdvantageResult, reinforce_plus_plus_advantages

    return AdvantageResult(reinforce_plus_plus_advantages(
        inputs.rewards, inputs.kl, inputs.response_lengths, inputs.loss_mask, settings.kl_coef, settings.gamma))


def _reinforce_plus_plus_baseline(inputs: AdvantageInputs, settings: AdvantageSettings) -> AdvantageResult:
    from vime_engine.algorithms.advantages import AdvantageResult, reinforce_plus_plus_baseline_advantages

    return AdvantageResult(reinforce_plus_plus_baseline_advantages(
        inputs.rewards, inputs.kl, inputs.response_lengths, inputs.loss_mask, inputs.group_size, settings.kl_coef,
        centre=not settings.rewards_normalized))


def _gae(inputs: AdvantageInputs, settings: AdvantageSettings) -> AdvantageResult:
    from vime_engine.algorithms.advantages import AdvantageResult, gae_advantages

    advantages, returns = gae_advantages(
        inputs.rewards, inputs.values, inputs.response_lengths, inputs.loss_mask, settings.gamma, settings.lam)
    return AdvantageResult(advantages, returns)


# grpo and gspo differ only in the loss.
ESTIMATORS: dict[str, EstimatorSpec] = {
    "grpo": EstimatorSpec(_group_normalized, group_baseline=True, std_normalized=True),
    "gspo": EstimatorSpec(_group_normalized, group_baseline=True, std_normalized=True, sequence_level_loss=True),
    "reinforce_plus_plus": EstimatorSpec(_reinforce_plus_plus, uses_reward_kl=True),
    "reinforce_plus_plus_baseline": EstimatorSpec(_reinforce_plus_plus_baseline, group_baseline=True,
                                                  uses_reward_kl=True),
    "ppo": EstimatorSpec(_gae, needs_critic=True),
}


def compute_advantages(
    estimator: str,
    inputs: AdvantageInputs,
    *,
    normalize_std: bool = True,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lam: float = 1.0,
    normalize_advantages: bool = False,
    rewards_normalized: bool = False,
) -> AdvantageResult:
    """Token-level advantages [N] for `--advantage-estimator` = a key of ESTIMATORS, and the critic's returns [N]
    where its spec needs a critic.

    ValueError for an unknown name, or when the spec reads `inputs.kl` / `inputs.values` and they are None.
    `normalize_std=False` (`--disable-grpo-std-normalization`) keeps the std out of a std-normalised group baseline
    (Dr. GRPO). `normalize_advantages` (`--normalize-advantages`) whitens the final advantages over the loss mask;
    returns are never whitened. `rewards_normalized`: the rewards were already normalised within their groups (by
    `--custom-reward-post-process-path`, as vime does it), so no estimator takes a group baseline of them again.
    """
    from vime_engine.algorithms.advantages import masked_whiten
    from vime_engine.algorithms.segments import check_flat

    check_flat(inputs.loss_mask, inputs.response_lengths, "loss_mask")
    spec = ESTIMATORS.get(estimator)
    if spec is None:
        raise ValueError(f"unknown --advantage-estimator {estimator!r}; expected one of {tuple(ESTIMATORS)}")
    for name, needed, tensor in (("kl", spec.uses_reward_kl, inputs.kl), ("values", spec.needs_critic, inputs.values)):
        if needed and tensor is None:
            raise ValueError(f"--advantage-estimator {estimator} needs per-token {name}")
    settings = AdvantageSettings(normalize_std=normalize_std and spec.std_normalized, kl_coef=kl_coef, gamma=gamma,
                                 lam=lam, rewards_normalized=rewards_normalized)
    result = spec.advantages(inputs, settings)
    if normalize_advantages:
        result = replace(result, advantages=masked_whiten(result.advantages, inputs.loss_mask))
    return result
