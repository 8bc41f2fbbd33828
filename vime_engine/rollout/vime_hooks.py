"""vime's rollout-side plugin hooks, called where the driver does the same step, with vime's call signatures.

Where each is called (the trainer's hooks: vime_engine/train/vime_hooks.py; the reward hooks:
vime_engine/rewards/custom.py):

- driver, per finished group (rollout/dynamic_sampling.py): --dynamic-sampling-filter-path
  `(args, samples) -> bool | DynamicFilterOutput`;
- driver, before a round resumes cut-off groups: --buffer-filter-path `(args, rollout_id, buffer, num_samples)
  -> groups`;
- driver, once the rollout's groups are collected: --rollout-sample-filter-path `(args, groups) -> None` (sets
  `sample.remove_sample`) on the kept groups, then --rollout-all-samples-process-path `(args, all_groups,
  data_source) -> None` on every group generated;
- driver, before logging: --custom-rollout-log-function-path `(rollout_id, args, samples, extra_metrics,
  rollout_time) -> bool`.

As in vime, `rollout_id` given to the buffer filter is None, a sample with `remove_sample` set keeps its place in
the advantages (its reward still counts in its group) but trains no token, and `True` from the log function
skips our own logging of that rollout (metrics.jsonl, TensorBoard, W&B, MLflow; the run's history is kept for
the checkpoint). `load_rollout_hooks` imports and checks every function, so `preflight` calls it before any
model loads; an exception inside one is named as the function's (vime_engine/plugins/boundary.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vime_engine.config import EngineConfig
from vime_engine.plugins.boundary import UserFunction, load_user_hook
from vime_engine.plugins.vime_args import vime_args
from vime_engine.rollout.dynamic_sampling import GroupFilter, load_group_filter
from vime_engine.sample import Sample

Groups = list[list[Sample]]


@dataclass
class RolloutHooks:
    """The driver's hooks for one run; a hook not given does what the engine does without it."""

    args: Any
    keep: GroupFilter
    buffer_filter: UserFunction | None = None
    sample_filter: UserFunction | None = None
    all_samples_process: UserFunction | None = None
    log_function: UserFunction | None = None

    def take_buffered(self, buffer: Groups, num_samples: int) -> Groups:
        """The cut-off groups to resume now, chosen by --buffer-filter-path (default: all of them, in order).

        As vime's data source, the filter may take them out of `buffer`; groups it returns are not resumed twice.
        """
        if self.buffer_filter is None or not buffer:
            return list(buffer)
        taken = self.buffer_filter.call(self.args, None, buffer, num_samples)
        if not isinstance(taken, list) or not all(isinstance(g, list) for g in taken):
            raise self.buffer_filter.error(f"returned {type(taken).__name__}; it must return a list of groups "
                                           "(lists of Samples) taken from the buffer")
        return taken

    def after_collect(self, kept: Groups, seen: Groups, data_source: Any) -> None:
        """--rollout-sample-filter-path on the kept groups (a removed sample's loss mask becomes all 0), then
        --rollout-all-samples-process-path on every group this rollout generated."""
        if self.sample_filter is not None:
            self.sample_filter.call(self.args, kept)
            for sample in (s for group in kept for s in group if s.remove_sample):
                sample.loss_mask = [0] * sample.response_length
        if self.all_samples_process is not None:
            self.all_samples_process.call(self.args, seen, data_source)

    def skip_default_log(self, rollout_id: int, samples: list[Sample], extra: dict[str, Any], seconds: float) -> bool:
        """Call --custom-rollout-log-function-path; True when it asks to skip our own logging."""
        if self.log_function is None:
            return False
        return bool(self.log_function.call(rollout_id, self.args, samples, extra, seconds))


def load_rollout_hooks(cfg: EngineConfig) -> RolloutHooks:
    r, lg = cfg.rollout, cfg.logging
    args = vime_args(cfg)
    filtering = r.over_sampling_batch_size is not None or r.dynamic_sampling_filter_path is not None
    return RolloutHooks(
        args=args,
        keep=load_group_filter(r.dynamic_sampling_filter_path, args) if filtering else (lambda group: True),
        buffer_filter=load_user_hook(
            r.buffer_filter_path, "--buffer-filter-path", ("args", "rollout_id", "buffer", "n"),
            "`(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]`"),
        sample_filter=load_user_hook(r.rollout_sample_filter_path, "--rollout-sample-filter-path", ("args", "samples"),
                                     "`(args, samples: list[list[Sample]]) -> None`"),
        all_samples_process=load_user_hook(r.rollout_all_samples_process_path, "--rollout-all-samples-process-path",
                                           ("args", "samples", "data_source"),
                                           "`(args, samples: list[list[Sample]], data_source) -> None`"),
        log_function=load_user_hook(lg.custom_rollout_log_function_path, "--custom-rollout-log-function-path",
                                    ("rollout_id", "args", "samples", "extra", "time"),
                                    "`(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool`"),
    )
