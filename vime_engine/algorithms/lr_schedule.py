"""The learning-rate schedule both training backends follow (`--lr`, `--min-lr`, `--lr-warmup-iters`,
`--lr-decay-style`, `--lr-decay-iters`).

`learning_rate(step)` is the LR of the optimizer step with 0-based index `step`:
- warmup: steps 0 … W-1 ramp linearly to `lr`, reaching `lr` at step W-1 (step k gets lr·(k+1)/W);
- then `constant` stays at `lr`; `linear` and `cosine` go from `lr` to `min_lr` over the next D - W steps
  (D = `--lr-decay-iters`, default the run's optimizer steps) and stay at `min_lr` after.
Invariants: lr >= value >= min_lr after warmup; the value at the first step after warmup is `lr`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 1
    style: str = "constant"  # constant | linear | cosine

    def learning_rate(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.style == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.decay_steps - self.warmup_steps))
        if self.style == "linear":
            shape = 1 - progress
        else:
            shape = 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * shape
