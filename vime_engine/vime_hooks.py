"""vime's plugin hooks, called where our engine does the same step, with vime's call signatures.

Every hook gets `args` (vime_engine.vime_args: read-only, vime's names) and our Samples (which answer vime's
attribute names, see vime_engine.sample). Where each is called:

- rollout worker, per finished group (rewards/custom.py): --custom-rm-path `async (args, sample) -> float`, or
  with --group-rm `async (args, samples) -> list[float]`;
- driver, per finished group (rollout/dynamic_sampling.py): --dynamic-sampling-filter-path
  `(args, samples) -> bool | DynamicFilterOutput`;
- driver, before a round resumes cut-off groups: --buffer-filter-path `(args, rollout_id, buffer, num_samples)
  -> groups`;
- driver, once the rollout's groups are collected: --rollout-sample-filter-path `(args, groups) -> None` (sets
  `sample.remove_sample`) on the kept groups, then --rollout-all-samples-process-path `(args, all_groups,
  data_source) -> None` on every group generated;
- driver, before logging: --custom-rollout-log-function-path `(rollout_id, args, samples, extra_metrics,
  rollout_time) -> bool`;
- trainer, before the advantages: --custom-reward-post-process-path `(args, samples) -> (raw_rewards, rewards)`;
  then --custom-advantage-function-path `(args, rollout_data) -> None` instead of the estimator.

As in vime, `rollout_id` given to the buffer filter is None, a sample with `remove_sample` set keeps its place in
the advantages (its reward still counts in its group) but trains no token, and `True` from the log function
skips our own logging of that rollout (metrics.jsonl, TensorBoard, W&B, MLflow; the run's history is kept for
the checkpoint). `load_rollout_hooks` and `load_trainer_hooks` import and check every function, so `preflight`
calls them before any model loads.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vime_engine.algorithms.advantages import (
    AdvantageInputs, AdvantageResult, compute_advantages, group_normalized_advantages, masked_whiten,
)
from vime_engine.config import EngineConfig
from vime_engine.plugins import call_plugin, load_function
from vime_engine.rollout.dynamic_sampling import GroupFilter, load_group_filter
from vime_engine.sample import Sample
from vime_engine.vime_args import vime_args

Groups = list[list[Sample]]


def _load(spec: str | None, flag: str, arg_names: tuple[str, ...], wanted: str) -> Callable | None:
    return None if spec is None else load_function(spec, flag, arg_names, wanted, allow_async=True)


@dataclass
class RolloutHooks:
    """The driver's hooks for one run; a hook not given does what the engine does without it."""

    args: Any
    keep: GroupFilter
    buffer_filter: Callable | None = None
    sample_filter: Callable | None = None
    all_samples_process: Callable | None = None
    log_function: Callable | None = None

    def take_buffered(self, buffer: Groups, num_samples: int) -> Groups:
        """The cut-off groups to resume now, chosen by --buffer-filter-path (default: all of them, in order).

        As vime's data source, the filter may take them out of `buffer`; groups it returns are not resumed twice.
        """
        if self.buffer_filter is None or not buffer:
            return list(buffer)
        taken = call_plugin(self.buffer_filter, self.args, None, buffer, num_samples)
        if not isinstance(taken, list) or not all(isinstance(g, list) for g in taken):
            raise TypeError(f"--buffer-filter-path returned {type(taken).__name__}; it must return a list of groups "
                            "(lists of Samples) taken from the buffer")
        return taken

    def after_collect(self, kept: Groups, seen: Groups, data_source: Any) -> None:
        """--rollout-sample-filter-path on the kept groups (a removed sample's loss mask becomes all 0), then
        --rollout-all-samples-process-path on every group this rollout generated."""
        if self.sample_filter is not None:
            call_plugin(self.sample_filter, self.args, kept)
            for sample in (s for group in kept for s in group if s.remove_sample):
                sample.loss_mask = [0] * sample.response_length
        if self.all_samples_process is not None:
            call_plugin(self.all_samples_process, self.args, seen, data_source)

    def skip_default_log(self, rollout_id: int, samples: list[Sample], extra: dict[str, Any], seconds: float) -> bool:
        """Call --custom-rollout-log-function-path; True when it asks to skip our own logging."""
        if self.log_function is None:
            return False
        return bool(call_plugin(self.log_function, rollout_id, self.args, samples, extra, seconds))


def load_rollout_hooks(cfg: EngineConfig) -> RolloutHooks:
    r, lg = cfg.rollout, cfg.logging
    args = vime_args(cfg)
    filtering = r.over_sampling_batch_size is not None or r.dynamic_sampling_filter_path is not None
    return RolloutHooks(
        args=args,
        keep=load_group_filter(r.dynamic_sampling_filter_path, args) if filtering else (lambda group: True),
        buffer_filter=_load(r.buffer_filter_path, "--buffer-filter-path", ("args", "rollout_id", "buffer", "n"),
                            "`(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]`"),
        sample_filter=_load(r.rollout_sample_filter_path, "--rollout-sample-filter-path", ("args", "samples"),
                            "`(args, samples: list[list[Sample]]) -> None`"),
        all_samples_process=_load(r.rollout_all_samples_process_path, "--rollout-all-samples-process-path",
                                  ("args", "samples", "data_source"),
                                  "`(args, samples: list[list[Sample]], data_source) -> None`"),
        log_function=_load(lg.custom_rollout_log_function_path, "--custom-rollout-log-function-path",
                           ("rollout_id", "args", "samples", "extra", "time"),
                           "`(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool`"),
    )


@dataclass
class TrainerHooks:
    """The trainer's hooks: they replace parts of the advantage computation of a rollout."""

    args: Any
    reward_post_process: Callable | None = None
    advantage_function: Callable | None = None

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
        out = call_plugin(self.reward_post_process, self.args, samples)
        try:
            _raw, processed = out
            processed = torch.as_tensor([float(x) for x in processed], dtype=rewards.dtype, device=rewards.device)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--custom-reward-post-process-path must return (raw_rewards, rewards), two lists of "
                             f"floats; got {type(out).__name__} ({exc})") from None
        if processed.shape != rewards.shape:
            raise ValueError(f"--custom-reward-post-process-path returned {processed.numel()} rewards for "
                             f"{rewards.numel()} samples; return one per sample, in order")
        return processed

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
        call_plugin(self.advantage_function, self.args, rollout_data)
        advantages = _joined(rollout_data.get("advantages"), "advantages", lengths, inputs.loss_mask)
        returns = rollout_data.get("returns")
        returns = None if returns is None else _joined(returns, "returns", lengths, inputs.loss_mask)
        if cfg.algorithm.normalize_advantages:  # vime whitens after a custom function too
            advantages = masked_whiten(advantages, inputs.loss_mask)
        return AdvantageResult(advantages=advantages, returns=returns)


def _joined(per_sample: Any, key: str, lengths: list[int], like: Tensor) -> Tensor:
    flag = "--custom-advantage-function-path"
    if not isinstance(per_sample, (list, tuple)) or len(per_sample) != len(lengths):
        raise ValueError(f"{flag} must set rollout_data[{key!r}] to a list of one tensor per sample "
                         f"({len(lengths)}); found {type(per_sample).__name__}")
    tensors = [torch.as_tensor(t, dtype=like.dtype, device=like.device).reshape(-1) for t in per_sample]
    wrong = [(i, t.numel(), n) for i, (t, n) in enumerate(zip(tensors, lengths)) if t.numel() != n]
    if wrong:
        i, got, n = wrong[0]
        raise ValueError(f"{flag}: rollout_data[{key!r}][{i}] has {got} values for a response of {n} tokens")
    return torch.cat(tensors) if tensors else like.new_zeros(0)


def vime_default_rewards(cfg: EngineConfig, rewards: Tensor, group_size: int) -> Tensor:
    """The rewards vime hands its advantage function when no post-process is given: group-normalised for the group
    estimators (centred, and divided by the std for grpo / gspo unless disabled), raw otherwise."""
    alg = cfg.algorithm
    if alg.advantage_estimator in ("grpo", "gspo", "reinforce_plus_plus_baseline"):
        std = alg.advantage_estimator != "reinforce_plus_plus_baseline" and not alg.disable_grpo_std_normalization
        return group_normalized_advantages(rewards, group_size, std)
    return rewards


@functools.lru_cache(maxsize=4)
def _trainer_hooks(cfg_json: str) -> TrainerHooks:
    cfg = EngineConfig.model_validate_json(cfg_json)
    alg, rw = cfg.algorithm, cfg.reward
    return TrainerHooks(
        args=vime_args(cfg),
        reward_post_process=_load(rw.custom_reward_post_process_path, "--custom-reward-post-process-path",
                                  ("args", "samples"), "`(args, samples: list[Sample]) -> (raw_rewards, rewards)`"),
        advantage_function=_load(alg.custom_advantage_function_path, "--custom-advantage-function-path",
                                 ("args", "rollout_data"), "`(args, rollout_data: dict) -> None`"),
    )


def load_trainer_hooks(cfg: EngineConfig) -> TrainerHooks:
    """The trainer's hooks, loaded once per configuration in each trainer process."""
    return _trainer_hooks(cfg.model_dump_json())
