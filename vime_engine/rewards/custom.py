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

from vime_engine.plugins.boundary import UserFunction, sample_labels
from vime_engine.plugins.loading import check_callable, import_function, parameter_names
from vime_engine.rewards.batch import RewardInput

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

    With `group_rm` (vime's `--group-rm`) the function must be vime's group form. Every failure to load is a
    ValueError naming the flag and the form expected; at run time, every value it returns is checked and an
    exception inside it named (a UserFunctionError, vime_engine/plugins/boundary.py).
    """
    fn = import_function(spec, FLAG, VIME_GROUP if group_rm else VIME)
    if group_rm:
        if not is_vime_form(fn):
            raise ValueError(f"{FLAG} {spec!r}: --group-rm calls it once per group, as {VIME_GROUP}; "
                             f"its first parameter must be `args` (found {parameter_names(fn)})")
        return VimeGroupReward(UserFunction(check_callable(fn, spec, FLAG, ("args", "samples"), VIME_GROUP, True),
                                            FLAG), args)
    if is_vime_form(fn):
        return VimeReward(UserFunction(check_callable(fn, spec, FLAG, ("args", "sample"), VIME, True), FLAG), args)
    return TextReward(UserFunction(check_callable(fn, spec, FLAG, ("response", "label"), OURS), FLAG))


def _labels(items: Sequence[RewardInput]) -> list[str]:
    """How messages name each item: by its Sample's group (vime_engine/plugins/boundary.py), else its position."""
    if all(item.sample is not None for item in items):
        return sample_labels([item.sample.group_index for item in items])
    return [f"sample {i}" for i in range(len(items))]


def _samples(items: Sequence[RewardInput]) -> list[Any]:
    missing = [i for i, item in enumerate(items) if item.sample is None]
    if missing:
        raise ValueError(f"{FLAG} in vime's form grades Samples, but items {missing} carry none")
    return [item.sample for item in items]


@dataclass(frozen=True)
class TextReward:
    """Our `(response, label) -> float` reward, run on every sample of a batch."""

    fn: UserFunction

    def __call__(self, items: Sequence[RewardInput]) -> list[float]:
        labels = _labels(items)
        return self.fn.numbers(self.fn.gather([(i.response, i.label) for i in items], labels), labels, "reward")


@dataclass(frozen=True)
class VimeReward:
    """vime's per-sample reward, run on every sample of a batch (concurrently when it is async)."""

    fn: UserFunction
    args: Any

    def __call__(self, items: Sequence[RewardInput]) -> list[float]:
        labels = _labels(items)
        return self.fn.numbers(self.fn.gather([(self.args, s) for s in _samples(items)], labels), labels, "reward")


@dataclass(frozen=True)
class VimeGroupReward:
    """vime's `--group-rm` reward: one call with the whole group, one reward back per sample."""

    fn: UserFunction
    args: Any

    def __call__(self, items: Sequence[RewardInput]) -> list[float]:
        samples = _samples(items)
        group = f"group {samples[0].group_index}" if samples else None
        return self.fn.numbers(self.fn.call(self.args, samples, sample=group), _labels(items), "reward", group)
