"""Finite values only: a run that diverged (a NaN or infinite loss, gradient norm or weight) stops, and what it
holds never becomes a checkpoint.

With `--lr 1e6` the gradient norm was NaN from rollout 1, the run went on, saved NaN in every weight and moved
LATEST onto it, so the next chunk, an evaluation or a publish took it. Now the driver stops at the first
non-finite training metric (vime_engine/runtime/driver.py), a save of safetensors files (the torch backends')
refuses non-finite tensors, and a load treats a checkpoint that holds them (written before this check) as it
treats a corrupt one: it is reported and skipped, so the run resumes from the newest finite checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vime_engine.config.errors import RunStoppedError

if TYPE_CHECKING:  # torch is imported where tensors are checked: the driver only checks metrics, and its start-up
    import torch   # would pay a second for it (bench/startup.py)

FIX = "lower --lr, keep --clip-grad on, or check the rewards and advantages the run trained on"
# What the trainers report of a step that a NaN or inf anywhere in the loss or its gradients turns non-finite.
TRAINING_METRICS = ("train/pg_loss", "train/kl_loss", "train/entropy_loss", "train/value_loss", "train/grad_norm")


class DivergenceError(RunStoppedError):
    """The run diverged; exit 2, since the fix is in its settings (FIX), and LATEST stays on the last finite
    checkpoint."""


class NonFiniteCheckpoint(ValueError):
    """A checkpoint file holds NaN or inf: a load skips that checkpoint, as it skips a corrupt one."""


def nonfinite_metrics(metrics: Mapping[str, float], names: tuple[str, ...]) -> list[str]:
    """Those of `names` present in `metrics` whose value is NaN or infinite, in the order of `names`."""
    return [n for n in names if n in metrics and not math.isfinite(metrics[n])]


def stop_if_diverged(rollout_id: int, metrics: Mapping[str, float]) -> None:
    """DivergenceError naming the rollout and its non-finite training metrics: called before the step's weights
    reach the engines or a checkpoint."""
    bad = nonfinite_metrics(metrics, TRAINING_METRICS)
    if bad:
        values = ", ".join(f"{name} = {metrics[name]}" for name in bad)
        raise DivergenceError(f"rollout {rollout_id} diverged: {values}; the run stops before saving it, so LATEST "
                              f"stays on the last finite checkpoint; {FIX}")


def nonfinite_tensors(tensors: Mapping[str, Any], name: str = "") -> list[str]:
    """The floating-point tensors holding a NaN or an infinity, in order (integer tensors are always finite), by
    name; nested dicts, lists and tuples (a loaded torch_dist state) are searched too, their names dotted."""
    import torch

    bad = []
    for key, value in (tensors.items() if isinstance(tensors, Mapping) else enumerate(tensors)):
        path = f"{name}.{key}" if name else str(key)
        if isinstance(value, torch.Tensor):
            if (value.is_floating_point() or value.is_complex()) and not _finite(value):
                bad.append(path)
        elif isinstance(value, Mapping | list | tuple):
            bad.extend(nonfinite_tensors(value, path))
    return bad


def _finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite. A NaN or inf anywhere makes the sum non-finite, and a sum reads the
    tensor once (about 5x faster than isfinite().all() here); a sum of finite values that overflows is checked
    value by value."""
    import torch

    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _first(bad: list[str]) -> str:
    return f"{', '.join(bad[:3])}{', …' if len(bad) > 3 else ''}"


def refuse_nonfinite_save(path: str | Path, bad: list[str], total: int | None = None) -> None:
    """DivergenceError naming the checkpoint and its first non-finite tensors (`bad`, of `total`), before any byte
    of it is written."""
    if bad:
        count = f"{len(bad)} of {total}" if total is not None else str(len(bad))
        raise DivergenceError(f"{path}: {count} tensors hold NaN or inf ({_first(bad)}): the run diverged, so this "
                              f"checkpoint is not saved and LATEST stays on the last finite one; {FIX}")


def check_finite_load(path: str | Path, bad: list[str]) -> None:
    """NonFiniteCheckpoint naming the checkpoint and its first non-finite tensors (`bad`)."""
    if bad:
        raise NonFiniteCheckpoint(f"{path}: {len(bad)} tensors hold NaN or inf ({_first(bad)}): a diverged run saved "
                                  "it; not resumed from")
