"""A plugin file written for vime, in vime's call signatures: it imports nothing from vimeflow.

Each function is what a vime user passes by flag (`--custom-rm-path tests/support/vime_plugins.py:custom_rm`, ...).
They read `args` and Samples by vime's names only. The ones that run in the driver or the trainer also append a
line to `<args.output_dir>/vime_plugins.jsonl`, so a test can see that they ran, where, and with what.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

import torch

try:  # vime keeps slime's package name
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput
except ImportError:
    @dataclass
    class DynamicFilterOutput:
        keep: bool
        reason: str | None = None


def _note(args, hook: str, **fields) -> None:
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "vime_plugins.jsonl"), "a") as f:
        f.write(json.dumps({"hook": hook, "pid": os.getpid(), **fields}) + "\n")


def _response_tokens(sample) -> list[int]:
    return sample.tokens[len(sample.tokens) - sample.response_length:]


async def custom_rm(args, sample) -> float:
    """--custom-rm-path: the share of even token ids in the response (graded, so groups rarely tie)."""
    await asyncio.sleep(0)  # a real one awaits a verifier or a server
    response = _response_tokens(sample)
    if sample.status.value == "aborted" or not response:
        return 0.0
    return sum(t % 2 == 0 for t in response) / len(response)


async def group_rm(args, samples) -> list[float]:
    """--custom-rm-path with --group-rm: rank of each response's length within its group, in [0, 1]."""
    assert len(samples) == args.n_samples_per_prompt
    order = sorted(range(len(samples)), key=lambda i: (samples[i].response_length, i))
    ranks = {i: r for r, i in enumerate(order)}
    return [ranks[i] / max(len(samples) - 1, 1) for i in range(len(samples))]


def dynamic_filter(args, samples, **kwargs) -> DynamicFilterOutput:
    """--dynamic-sampling-filter-path: keep groups whose rewards spread (DAPO's rule), naming the drop."""
    rewards = torch.tensor([s.get_reward_value(args) for s in samples], dtype=torch.float64)
    keep = bool(rewards.std() > 1e-6)
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(float(rewards[0]), 1)}")


def buffer_filter(args, rollout_id, buffer, num_samples):
    """--buffer-filter-path: resume the most recently cut-off groups first (vime's default pops the oldest)."""
    count = min(len(buffer), num_samples)
    taken = buffer[len(buffer) - count:][::-1]
    del buffer[len(buffer) - count:]
    return taken


def rollout_sample_filter(args, samples) -> None:
    """--rollout-sample-filter-path: the lowest-reward sample of each group stays out of the loss."""
    for group in samples:
        min(group, key=lambda s: s.get_reward_value(args)).remove_sample = True
    _note(args, "rollout_sample_filter", groups=len(samples))


def rollout_all_samples_process(args, samples, data_source) -> None:
    """--rollout-all-samples-process-path: counts every group generated, kept or not."""
    _note(args, "rollout_all_samples_process", groups=len(samples),
          sizes=sorted({len(g) for g in samples}), has_data_source=data_source is not None)


def reward_post_process(args, samples):
    """--custom-reward-post-process-path: Dr. GRPO's rewards, centred in each group but not divided by the std."""
    raw = [s.get_reward_value(args) for s in samples]
    n = args.n_samples_per_prompt
    rewards = []
    for start in range(0, len(raw), n):
        group = raw[start:start + n]
        mean = sum(group) / len(group)
        rewards += [r - mean for r in group]
    _note(args, "reward_post_process", samples=len(samples), rewards=rewards)
    return raw, rewards


def custom_advantage(args, rollout_data) -> None:
    """--custom-advantage-function-path: each sample's reward on its trained tokens, no critic."""
    advantages = [torch.full_like(mask, float(r)) * mask
                  for r, mask in zip(rollout_data["rewards"], rollout_data["loss_masks"])]
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = advantages
    _note(args, "custom_advantage", rewards=list(rollout_data["rewards"]),
          masked_out=[int((m == 0).all()) for m in rollout_data["loss_masks"]])


def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    """--custom-rollout-log-function-path: its own summary line, and the default logging goes on (False)."""
    _note(args, "log_rollout", rollout_id=rollout_id, samples=len(samples), seconds=rollout_time,
          mean_reward=sum(s.get_reward_value(args) for s in samples) / len(samples),
          extra=sorted(rollout_extra_metrics))
    return False


def log_rollout_instead(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool:
    """--custom-rollout-log-function-path: logs on its own and skips the default logging (True)."""
    _note(args, "log_rollout_instead", rollout_id=rollout_id)
    return True
