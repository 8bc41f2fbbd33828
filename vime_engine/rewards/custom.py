"""Loading a user's reward function from `--custom-rm-path`, in either of two forms.

- vimeflow's `(response: str, label: str) -> float`, a plain function;
- vime's `async (args, sample) -> float` (the `args` namespace and our Sample), or with `--group-rm`
  `async (args, samples: list[Sample]) -> list[float]`, called once per group.

The form is read from the signature: a coroutine function, or one whose first parameter is named `args`, is
vime's; anything else is ours. vime's form may also be a plain function.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vime_engine.plugins.loading import check_callable, gather_plugin, import_function, parameter_names
from vime_engine.rewards.batch import PerSampleReward, RewardInput

RewardFn = Callable[[str, str], float]
FLAG = "--custom-rm-path"
OURS = "`(response: str, label: str) -> float`"
VIME = "`async (args, sample) -> float`"
VIME_GROUP = "`async (args, samples: list[Sample]) -> list[float]`"


def is_vime_form(fn: Callable) -> bool:
    names = parameter_names(fn)
    return inspect.iscoroutinefunction(fn) or bool(names) and names[0] in ("args", "_args")


def load_custom_reward(spec: str) -> RewardFn:
    """The function named by `spec`, checked to be callable as `fn(response, label)`; vime's form is refused
    here, since this caller has no Sample to give it (the rollout worker uses `load_sample_reward`)."""
    fn = import_function(spec, FLAG, OURS)
    if is_vime_form(fn):
        raise ValueError(f"{FLAG} {spec!r} is in vime's form {VIME}; this use grades text alone and needs {OURS}")
    return check_callable(fn, spec, FLAG, ("response", "label"), OURS)


def load_sample_reward(spec: str, args: Any, group_rm: bool = False) -> Callable[[Sequence[RewardInput]], list[float]]:
    """The reward of a group of samples from the function named by `spec`, in whichever form it is written.

    With `group_rm` (vime's `--group-rm`) the function must be vime's group form. Every failure is a ValueError
    naming the flag and the form expected.
    """
    fn = import_function(spec, FLAG, VIME_GROUP if group_rm else VIME)
    if group_rm:
        if not is_vime_form(fn):
            raise ValueError(f"{FLAG} {spec!r}: --group-rm calls it once per group, as {VIME_GROUP}; "
                             f"its first parameter must be `args` (found {parameter_names(fn)})")
        return VimeGroupReward(check_callable(fn, spec, FLAG, ("args", "samples"), VIME_GROUP, True), args, spec)
    if is_vime_form(fn):
        return VimeReward(check_callable(fn, spec, FLAG, ("args", "sample"), VIME, True), args)
    return PerSampleReward(check_callable(fn, spec, FLAG, ("response", "label"), OURS))


def _samples(items: Sequence[RewardInput]) -> list[Any]:
    missing = [i for i, item in enumerate(items) if item.sample is None]
    if missing:
        raise ValueError(f"{FLAG} in vime's form grades Samples, but items {missing} carry none")
    return [item.sample for item in items]


@dataclass(frozen=True)
class VimeReward:
    """vime's per-sample reward, run on every sample of a batch (concurrently when it is async)."""

    fn: Callable
    args: Any

    def __call__(self, items: Sequence[RewardInput]) -> list[float]:
        return [float(r) for r in gather_plugin(self.fn, [(self.args, s) for s in _samples(items)])]


@dataclass(frozen=True)
class VimeGroupReward:
    """vime's `--group-rm` reward: one call with the whole group, one reward back per sample."""

    fn: Callable
    args: Any
    spec: str

    def __call__(self, items: Sequence[RewardInput]) -> list[float]:
        samples = _samples(items)
        rewards = gather_plugin(self.fn, [(self.args, samples)])[0]
        if len(rewards) != len(samples):
            raise ValueError(f"{FLAG} {self.spec!r} (--group-rm) returned {len(rewards)} rewards for a group of "
                             f"{len(samples)} samples; return one per sample, in order")
        return [float(r) for r in rewards]
