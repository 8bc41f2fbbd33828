"""vime's trainer-side plugin hooks: they replace parts of the advantage computation of a rollout.

- before the advantages: --custom-reward-post-process-path `(args, samples) -> (raw_rewards, rewards)`;
- then --custom-advantage-function-path `(args, rollout_data) -> None` instead of the estimator.

Every hook gets `args` (vime_engine/plugins/vime_args.py: read-only, vime's names) and our Samples (which answer
vime's attribute names, see vime_engine/sample.py). `load_trainer_hooks` imports and checks both, so `preflight`
calls it before any model loads; what they return is checked, one value per sample and every value finite
(vime_engine/plugins/boundary.py). The rollout side's hooks: vime_engine/rollout/vime_hooks.py.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vime_engine.algorithms.advantages import (
    AdvantageInputs, AdvantageResult, group_normalized_advantages, masked_whiten,
)
from vime_engine.algorithms.estimators import ESTIMATORS, compute_advantages
from vime_engine.config import EngineConfig
from vime_engine.plugins.boundary import UserFunction, load_user_hook, sample_labels
from vime_engine.plugins.vime_args import vime_args
from vime_engine.sample import Sample


@dataclass
class TrainerHooks:
    """The trainer's hooks: they replace parts of the advantage computation of a rollout."""

    args: Any
    reward_post_process: UserFunction | None = None
    advantage_function: UserFunction | None = None

    def advantages(self, cfg: EngineConfig, samples: list[Sample], inputs: AdvantageInputs,
                   log_probs: dict[str, Tensor | None]) -> AdvantageResult:
        """The configured estimator's advantages, with the reward post-process and the custom advantage function
        in their places. `log_probs`: flat "log_probs", "ref_log_probs", "rollout_log_probs" (None if absent)."""
        alg = cfg.algorithm
        rewards, normalized = inputs.rewards, False
        if self.reward_post_process is not None:
            rewards, normalized = self._post_processed(samples, rewards), True
        if self.advantage_function is None:
            return compute_advantages(
                alg.advantage_estimator, dataclasses.replace(inputs, rewards=rewards),
                normalize_std=not alg.disable_grpo_std_normalization, kl_coef=alg.kl_coef, gamma=alg.gamma,
                lam=alg.lambd, normalize_advantages=alg.normalize_advantages, rewards_normalized=normalized,
            )
        if not normalized:
            rewards = vime_default_rewards(cfg, rewards, inputs.group_size)
        return self._custom(cfg, samples, inputs, rewards, log_probs)

    def _post_processed(self, samples: list[Sample], rewards: Tensor) -> Tensor:
        hook = self.reward_post_process
        out = hook.call(self.args, samples)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise hook.error(f"returned {type(out).__name__}; return (raw_rewards, rewards), two lists of one float "
                             "per sample")
        processed = hook.numbers(out[1], sample_labels([s.group_index for s in samples]), "post-processed reward")
        return torch.as_tensor(processed, dtype=rewards.dtype, device=rewards.device)

    def _custom(self, cfg: EngineConfig, samples: list[Sample], inputs: AdvantageInputs, rewards: Tensor,
                log_probs: dict[str, Tensor | None]) -> AdvantageResult:
        lengths = list(inputs.response_lengths)
        split = lambda t: None if t is None else list(torch.split(t, lengths))  # noqa: E731
        rollout_data: dict[str, Any] = {
            "rewards": rewards.tolist(), "raw_reward": [s.reward for s in samples],
            "response_lengths": lengths, "total_lengths": [s.total_length for s in samples],
            "loss_masks": split(inputs.loss_mask), "kl": split(inputs.kl if inputs.kl is not None
                                                              else torch.zeros_like(inputs.loss_mask)),
            "values": split(inputs.values), **{k: split(v) for k, v in log_probs.items()},
        }
        hook, labels = self.advantage_function, sample_labels([s.group_index for s in samples])
        hook.call(self.args, rollout_data)
        advantages = _joined(hook, rollout_data.get("advantages"), "advantages", labels, lengths, inputs.loss_mask)
        returns = rollout_data.get("returns")
        returns = None if returns is None else _joined(hook, returns, "returns", labels, lengths, inputs.loss_mask)
        if cfg.algorithm.normalize_advantages:  # vime whitens after a custom function too
            advantages = masked_whiten(advantages, inputs.loss_mask)
        return AdvantageResult(advantages=advantages, returns=returns)


def _joined(hook: UserFunction, per_sample: Any, key: str, labels: list[str], lengths: list[int],
            like: Tensor) -> Tensor:
    """What the advantage function set in rollout_data[key], one token tensor per sample, joined: every sample's
    count and finiteness checked, since a NaN advantage would reach every weight through the loss."""
    if not isinstance(per_sample, (list, tuple)) or len(per_sample) != len(lengths):
        raise hook.error(f"must set rollout_data[{key!r}] to a list of one tensor per sample ({len(lengths)}); "
                         f"found {type(per_sample).__name__}")
    tensors = [torch.as_tensor(t, dtype=like.dtype, device=like.device).reshape(-1) for t in per_sample]
    for label, t, n in zip(labels, tensors, lengths):
        if t.numel() != n:
            raise hook.error(f"set rollout_data[{key!r}] to {t.numel()} values for a response of {n} tokens", label)
        if not bool(torch.isfinite(t).all()):
            bad = t[~torch.isfinite(t)][0].item()
            raise hook.error(f"set rollout_data[{key!r}] to a value of {bad!r}; every value must be finite", label)
    return torch.cat(tensors) if tensors else like.new_zeros(0)


def vime_default_rewards(cfg: EngineConfig, rewards: Tensor, group_size: int) -> Tensor:
    """The rewards vime hands its advantage function when no post-process is given: centred in their groups for an
    estimator with a group baseline (and divided by the group's std where it is std-normalised, unless
    --disable-grpo-std-normalization), raw otherwise."""
    alg = cfg.algorithm
    spec = ESTIMATORS[alg.advantage_estimator]
    if spec.group_baseline:
        std = spec.std_normalized and not alg.disable_grpo_std_normalization
        return group_normalized_advantages(rewards, group_size, std)
    return rewards


@functools.lru_cache(maxsize=4)
def _trainer_hooks(cfg_json: str) -> TrainerHooks:
    cfg = EngineConfig.model_validate_json(cfg_json)
    alg, rw = cfg.algorithm, cfg.reward
    return TrainerHooks(
        args=vime_args(cfg),
        reward_post_process=load_user_hook(rw.custom_reward_post_process_path, "--custom-reward-post-process-path",
                                           ("args", "samples"),
                                           "`(args, samples: list[Sample]) -> (raw_rewards, rewards)`"),
        advantage_function=load_user_hook(alg.custom_advantage_function_path, "--custom-advantage-function-path",
                                          ("args", "rollout_data"), "`(args, rollout_data: dict) -> None`"),
    )


def load_trainer_hooks(cfg: EngineConfig) -> TrainerHooks:
    """The trainer's hooks, loaded once per configuration in each trainer process."""
    return _trainer_hooks(cfg.model_dump_json())
