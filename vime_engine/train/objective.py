"""The RL objective of one micro-batch, shared by every training backend.

A backend produces per-token log-probs (and entropy, values) for a micro-batch; this module turns them and
the rollout's tensors into the loss to backpropagate and the metrics to log, using the pure functions in
`vime_engine.algorithms`. Losses are reduced with global denominators so micro-batch gradients add up to the
global-batch gradient exactly, however the samples were packed.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from vime_engine.algorithms.estimators import ESTIMATORS
from vime_engine.algorithms.losses import (
    gspo_policy_loss,
    kl_penalty,
    loss_reducer,
    policy_loss,
    ppo_kl,
    tis_weights,
    value_loss,
)
from vime_engine.algorithms.lr_schedule import LRSchedule
from vime_engine.algorithms.token_log_probs import token_log_probs_and_entropy
from vime_engine.config import EngineConfig


@dataclass
class MicroBatchTargets:
    """Per-token tensors of one micro-batch fixed before the optimizer step (flat layout)."""

    response_lengths: list[int]
    loss_mask: Tensor
    advantages: Tensor
    # The trainer's own log-probs before this rollout's updates; None when the rollout is one optimizer step, so
    # the policy has not moved yet and they are the training forward's own, detached (no separate pass).
    old_log_probs: Tensor | None
    rollout_log_probs: Tensor  # what vLLM reported while sampling
    ref_log_probs: Tensor | None = None
    returns: Tensor | None = None  # critic targets (an estimator that needs a critic)
    old_values: Tensor | None = None


@dataclass
class MicroBatchOutputs:
    log_probs: Tensor
    entropy: Tensor | None = None  # [N] of the sampling distribution (after temperature)
    values: Tensor | None = None
    # The router's load-balancing loss over the micro-batch's tokens (a mixture-of-experts model, with
    # --moe-aux-loss-coeff > 0; otherwise not computed)
    moe_aux_loss: Tensor | None = None


def micro_batch_loss(
    cfg: EngineConfig,
    out: MicroBatchOutputs,
    tgt: MicroBatchTargets,
    global_num_tokens: int,
    global_num_samples: int,
) -> tuple[Tensor, dict[str, float]]:
    """Loss of one micro-batch (its share of the global batch) and its share of each metric.

    The router's load-balancing loss is a statistic of the tokens routed together, not a sum over tokens: each
    micro-batch's counts as its share of the step's samples, so the step's `train/moe_aux_loss` (the shares summed
    over micro-batches and ranks) is the sample-weighted mean of the micro-batches' losses, and the loss adds
    `--moe-aux-loss-coeff` times it (Megatron's aux_loss likewise averages its micro-batches' losses)."""
    alg = cfg.algorithm
    old_log_probs = tgt.old_log_probs if tgt.old_log_probs is not None else out.log_probs.detach()
    reduce = loss_reducer(
        tgt.response_lengths, tgt.loss_mask, alg.calculate_per_token_loss, global_num_tokens, global_num_samples
    )
    if ESTIMATORS[alg.advantage_estimator].sequence_level_loss:
        pg, clipped = gspo_policy_loss(
            out.log_probs, old_log_probs, tgt.advantages, tgt.response_lengths, tgt.loss_mask,
            alg.eps_clip, cfg.eps_clip_high,
        )
    else:
        pg, clipped = policy_loss(
            out.log_probs, old_log_probs, tgt.advantages, alg.eps_clip, cfg.eps_clip_high, alg.eps_clip_c
        )
    if alg.use_tis:
        pg = pg * tis_weights(old_log_probs, tgt.rollout_log_probs, alg.tis_clip)

    pg_loss = reduce(pg)
    loss = pg_loss
    metrics = {
        "train/pg_loss": pg_loss.item(),
        "train/pg_clipfrac": reduce(clipped).item(),
        "train/ppo_kl": reduce(ppo_kl(out.log_probs.detach(), old_log_probs)).item(),
        "train/train_rollout_logprob_abs_diff": reduce((old_log_probs - tgt.rollout_log_probs).abs()).item(),
    }
    if out.entropy is not None:
        entropy = reduce(out.entropy)
        if alg.entropy_coef != 0:  # otherwise the entropy is a metric only and needs no backward
            loss = loss - alg.entropy_coef * entropy
        metrics["train/entropy_loss"] = entropy.item()
    if alg.use_kl_loss:
        kl = reduce(kl_penalty(out.log_probs, tgt.ref_log_probs, alg.kl_loss_type))
        loss = loss + alg.kl_loss_coef * kl
        metrics["train/kl_loss"] = kl.item()
    if out.values is not None:
        vf = reduce(value_loss(out.values, tgt.old_values, tgt.returns, alg.value_clip))
        loss = loss + vf
        metrics["train/value_loss"] = vf.item()
    if out.moe_aux_loss is not None:
        aux = out.moe_aux_loss * (len(tgt.response_lengths) / global_num_samples)
        loss = loss + alg.moe_aux_loss_coeff * aux
        metrics["train/moe_aux_loss"] = aux.item()
    return loss, metrics


def needs_reference(cfg: EngineConfig) -> bool:
    """A reference model: for the KL loss, or for the KL in the reward of an estimator that folds --kl-coef into it."""
    alg = cfg.algorithm
    return alg.use_kl_loss or (alg.kl_coef > 0 and ESTIMATORS[alg.advantage_estimator].uses_reward_kl)


def response_log_probs(logits: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """log p(token) under softmax(logits / T): the same quantity vLLM reports as processed log-probs."""
    return token_log_probs_and_entropy(logits, tokens, temperature, with_entropy=False)[0]


def lr_schedule(cfg: EngineConfig) -> LRSchedule:
    """The run's LR schedule; `--lr-decay-iters` defaults to the run's optimizer steps."""
    t = cfg.train
    run_steps = cfg.rollout.num_rollout * (cfg.samples_per_rollout // cfg.global_batch_size)
    return LRSchedule(t.lr, t.min_lr, t.lr_warmup_iters, max(1, t.lr_decay_iters or run_steps), t.lr_decay_style)
