"""Pure tensor math of RL post-training: advantages, losses, micro-batch packing (no I/O, no state)."""

from vime_engine.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageResult,
    compute_advantages,
    expand_to_tokens,
    gae_advantages,
    group_normalized_advantages,
    masked_whiten,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
)
from vime_engine.algorithms.losses import (
    KL_TYPES,
    entropy_from_logits,
    gspo_policy_loss,
    kl_penalty,
    loss_reducer,
    policy_loss,
    ppo_kl,
    tis_weights,
    value_loss,
)
from vime_engine.algorithms.packing import fixed_size_micro_batches, pack_by_padded_length

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_TYPES",
    "AdvantageInputs",
    "AdvantageResult",
    "compute_advantages",
    "entropy_from_logits",
    "expand_to_tokens",
    "fixed_size_micro_batches",
    "gae_advantages",
    "group_normalized_advantages",
    "gspo_policy_loss",
    "kl_penalty",
    "loss_reducer",
    "masked_whiten",
    "pack_by_padded_length",
    "policy_loss",
    "ppo_kl",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "tis_weights",
    "value_loss",
]
