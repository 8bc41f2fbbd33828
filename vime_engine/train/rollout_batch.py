"""One rollout's training tensors, shared by the training backends.

A backend computes the rollout's old (and reference, value) per-token log-probs in its own way; from them this
module builds the advantages and hands out `MicroBatchTargets` for any subset of samples, in the flat
per-token layout the shared loss (`vime_engine.train.objective`) expects, plus the global-batch plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vime_engine.algorithms.advantages import AdvantageInputs, AdvantageResult
from vime_engine.algorithms.estimators import ESTIMATORS
from vime_engine.algorithms.losses import kl_penalty
from vime_engine.config import EngineConfig
from vime_engine.sample import Sample
from vime_engine.train.objective import MicroBatchTargets
from vime_engine.train.vime_hooks import load_trainer_hooks


@dataclass
class RolloutBatch:
    """Flat per-token tensors of a rollout; sample i owns tokens offsets[i]:offsets[i+1]."""

    lengths: list[int]
    offsets: list[int]
    loss_mask: Tensor
    old_log_probs: Tensor | None  # None: the training forward's own (see `old_log_probs_from_training_forward`)
    rollout_log_probs: Tensor
    advantages: AdvantageResult
    ref_log_probs: Tensor | None = None
    old_values: Tensor | None = None

    def token_index(self, indices: list[int]) -> Tensor:
        device = self.loss_mask.device
        return torch.cat([torch.arange(self.offsets[i], self.offsets[i + 1]) for i in indices]).to(device)

    def targets(self, indices: list[int]) -> MicroBatchTargets:
        idx = self.token_index(indices)
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return MicroBatchTargets(
            response_lengths=[self.lengths[i] for i in indices], loss_mask=self.loss_mask[idx],
            advantages=self.advantages.advantages[idx], old_log_probs=pick(self.old_log_probs),
            rollout_log_probs=self.rollout_log_probs[idx], ref_log_probs=pick(self.ref_log_probs),
            returns=pick(self.advantages.returns), old_values=pick(self.old_values),
        )

    def num_tokens(self, indices: list[int]) -> int:
        """Loss-bearing tokens of these samples: the global denominator of a per-token loss."""
        return int(sum(self.loss_mask[self.offsets[i]:self.offsets[i + 1]].sum().item() for i in indices))


def old_log_probs_from_training_forward(cfg: EngineConfig, num_samples: int) -> bool:
    """Whether a rollout's old log-probs can be the training forward's own, detached, instead of a separate
    no-grad pass over the rollout first: yes when the rollout is one optimizer step (the policy has not moved
    when any micro-batch's forward runs, so old == current), the advantages do not read them before training
    (the KL to the reference of an estimator that folds `--kl-coef` into the reward), and no routing is to be
    recorded in that pass (`--use-routing-replay` without the rollout's routing: slime runs the pass for it too)."""
    alg = cfg.algorithm
    kl_in_advantages = ESTIMATORS[alg.advantage_estimator].uses_reward_kl and alg.kl_coef != 0
    kl_in_advantages |= alg.custom_advantage_function_path is not None  # vime's function may read them
    records_routing = alg.routing_replay == "old_policy"
    return len(global_batches(num_samples, cfg.global_batch_size)) == 1 and not kl_in_advantages and not records_routing


def build_rollout_batch(
    cfg: EngineConfig,
    samples: list[Sample],
    old_log_probs: Tensor | None,
    ref_log_probs: Tensor | None = None,
    old_values: Tensor | None = None,
    *,
    device: torch.device,
) -> RolloutBatch:
    """Advantages of the whole rollout (the configured estimator) and its flat target tensors; `old_log_probs`
    None when `old_log_probs_from_training_forward` holds."""
    lengths = [s.response_length for s in samples]
    mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float32, device=device)
    if old_log_probs is None and not old_log_probs_from_training_forward(cfg, len(samples)):
        raise ValueError("this rollout needs its old log-probs before training (several optimizer steps, or "
                         "the KL to the reference in the advantages)")
    if ref_log_probs is not None and old_log_probs is not None:
        kl = kl_penalty(old_log_probs, ref_log_probs, "k1")
    else:  # no reference, or the advantages do not read the KL (checked above)
        kl = torch.zeros_like(mask)
    rollout_lp = torch.tensor([x for s in samples for x in s.rollout_log_probs], device=device)
    inputs = AdvantageInputs(
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32, device=device),
        response_lengths=lengths, loss_mask=mask, group_size=cfg.rollout.n_samples_per_prompt, kl=kl,
        values=old_values,
    )
    # The configured estimator, or vime's reward post-process / advantage function in its place.
    result = load_trainer_hooks(cfg).advantages(
        cfg, samples, inputs,
        {"log_probs": old_log_probs, "ref_log_probs": ref_log_probs, "rollout_log_probs": rollout_lp},
    )
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return RolloutBatch(lengths, offsets, mask, old_log_probs, rollout_lp, result, ref_log_probs, old_values)


def global_batches(num_samples: int, global_batch_size: int) -> list[list[int]]:
    """Sample indices of each optimizer step, in rollout order."""
    return [list(range(start, min(start + global_batch_size, num_samples)))
            for start in range(0, num_samples, global_batch_size)]
