"""Per-token losses of RL post-training, and their reduction to a micro-batch loss.

Layout: see `segments.py` (flat token tensors [N] plus `response_lengths`). Every loss here is per token
and unreduced; `loss_reducer` turns it into the micro-batch's share of the global-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vime_engine.algorithms.segments import check_flat, expand_to_tokens, segment_sum

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")

__all__ = [
    "KL_TYPES",
    "entropy_from_logits",
    "gspo_policy_loss",
    "kl_penalty",
    "loss_reducer",
    "policy_loss",
    "ppo_kl",
    "tis_weights",
    "value_loss",
]


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float
                       ) -> tuple[Tensor, Tensor]:
    """max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).to(ratio.dtype)


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token, with clip-higher and optional dual-clip.

    ratio = exp(log_probs - old_log_probs); loss = max(-A * ratio, -A * clip(ratio, 1 - eps_clip,
    1 + eps_clip_high)) (`--eps-clip`, `--eps-clip-high`). Dual-clip (`--eps-clip-c`, > 1): where A < 0 the
    loss is further capped at -eps_clip_c * A, bounding the push-down on a token whose ratio blew up.
    Returns (loss [N], clipped [N]): clipped is 1.0 where a clip (either one) replaced the unclipped
    surrogate, i.e. where the token gets no gradient; its masked mean is the clip fraction.
    """
    if eps_clip_c is not None and eps_clip_c <= 1.0:
        raise ValueError(f"--eps-clip-c must be > 1, got {eps_clip_c}")
    ratio = torch.exp(log_probs - old_log_probs)
    loss, clipped = _clipped_surrogate(ratio, advantages, eps_clip, eps_clip_high)
    if eps_clip_c is not None:
        cap = -advantages * eps_clip_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        clipped = torch.maximum(clipped, dual.to(clipped.dtype))
    return loss, clipped


def gspo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_lengths: Sequence[int],
    loss_mask: Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> tuple[Tensor, Tensor]:
    """GSPO: the PPO clipped surrogate on a sequence-level importance ratio, in its per-token form.

    s_i = exp(masked mean over sample i's tokens of (log_probs - old_log_probs)); a sample without trained
    tokens has s_i = 1. Per token (GSPO-token): s_it = sg(s_i) * exp(log_probs_t - sg(log_probs_t)), whose
    value is s_i and whose gradient is s_i * grad(log_probs_t); so with the per-sample mean reduction and A
    constant over a sample, the gradient equals GSPO's sequence-level one. The clip applies to s_i, so a
    sample is clipped as a whole. Returns (loss [N], clipped [N]), clipped constant over each sample.
    """
    check_flat(log_probs, response_lengths, "log_probs")
    mask = (loss_mask > 0).to(log_probs.dtype)
    counts = segment_sum(mask, response_lengths).clamp(min=1.0)
    mean_log_ratio = segment_sum((log_probs - old_log_probs) * mask, response_lengths) / counts
    seq_log_ratio = expand_to_tokens(mean_log_ratio, response_lengths).detach()
    token_ratio = torch.exp(seq_log_ratio + log_probs - log_probs.detach())
    return _clipped_surrogate(token_ratio, advantages, eps_clip, eps_clip_high)


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kl_type: str) -> Tensor:
    """Per-token KL estimate between the policy and the reference, from sampled-token log-probs.

    With d = log_probs - ref_log_probs (`--kl-loss-type`): k1 = d (unbiased, high variance);
    k2 = d^2 / 2; k3 = exp(-d) + d - 1 (unbiased, >= 0); low_var_kl = k3 clamped to [-10, 10].
    """
    log_ratio = log_probs - ref_log_probs
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    if kl_type in ("k3", "low_var_kl"):
        k3 = torch.exp(-log_ratio) + log_ratio - 1.0
        return k3.clamp(-10.0, 10.0) if kl_type == "low_var_kl" else k3
    raise ValueError(f"unknown --kl-loss-type {kl_type!r}; expected one of {KL_TYPES}")


def ppo_kl(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    """Per-token approximate KL(old || new) = old_log_probs - log_probs, the `train/ppo_kl` metric.

    It is exactly 0 on the first step after a weight sync (the resume-equivalence check relies on that).
    """
    return old_log_probs - log_probs


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dimension: -sum p log p. [..., V] -> [...].

    Computed from log_softmax (max-shifted, so large logits do not overflow) as -sum exp(lp) * lp rather
    than logsumexp - sum p * z, which cancels catastrophically for a peaked distribution. Entries with
    p == 0 (logit -inf) contribute 0, with a finite gradient.
    """
    log_p = torch.log_softmax(logits, dim=-1)
    finite_log_p = torch.where(torch.isfinite(log_p), log_p, torch.zeros_like(log_p))
    return -(log_p.exp() * finite_log_p).sum(dim=-1)


def tis_weights(train_old_log_probs: Tensor, rollout_log_probs: Tensor, clip: float) -> Tensor:
    """Truncated importance sampling weight min(exp(train - rollout), clip), detached.

    Corrects for the rollout engine sampling from a slightly different distribution than the trainer
    computes (`--use-tis --tis-clip`); multiply the per-token policy loss by it.
    """
    if clip <= 0:
        raise ValueError(f"--tis-clip must be > 0, got {clip}")
    return torch.exp(train_old_log_probs - rollout_log_probs).clamp(max=clip).detach()


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float) -> Tensor:
    """PPO's clipped value loss per token: 0.5 * max((V - R)^2, (V_clip - R)^2).

    V_clip = old_values + clip(values - old_values, -value_clip, value_clip): the critic may not move
    further than value_clip from the value it had at rollout time to lower the loss.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    return 0.5 * torch.maximum((values - returns).square(), (clipped_values - returns).square())


def loss_reducer(
    response_lengths: Sequence[int],
    loss_mask: Tensor,
    per_token: bool,
    global_num_tokens: int,
    global_num_samples: int,
) -> Callable[[Tensor], Tensor]:
    """Reduce a micro-batch's per-token values to its share of the global-batch loss.

    per_token=True (`--calculate-per-token-loss`): sum of masked token values / global_num_tokens, the
    number of masked tokens in the whole global batch. per_token=False: sum over the micro-batch's samples
    of (sample's masked token mean) / global_num_samples, the number of samples in the global batch; a
    sample without masked tokens adds 0.

    Invariant: both are sums of per-sample terms whose denominators are global, so for any split of a
    global batch into micro-batches the sum of the reduced micro-batch values equals the reduced global
    batch; summing (accumulating) micro-batch gradients gives the global-batch gradient exactly. The
    returned callable is `values [N] -> scalar`, as a weighted sum sum_t w_t * values_t.
    """
    check_flat(loss_mask, response_lengths, "loss_mask")
    mask = (loss_mask > 0).to(torch.float64)
    if per_token:
        if global_num_tokens <= 0:
            raise ValueError(f"global_num_tokens must be > 0, got {global_num_tokens}")
        weights = mask / global_num_tokens
    else:
        if global_num_samples <= 0:
            raise ValueError(f"global_num_samples must be > 0, got {global_num_samples}")
        per_sample_tokens = segment_sum(mask, response_lengths).clamp(min=1.0)
        weights = mask / expand_to_tokens(per_sample_tokens, response_lengths) / global_num_samples

    def reduce(values: Tensor) -> Tensor:
        check_flat(values, response_lengths, "values")
        return (values * weights.to(values.dtype)).sum()

    return reduce
