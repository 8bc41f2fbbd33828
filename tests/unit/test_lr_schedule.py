"""The one LR schedule both backends follow, against hand-worked values."""

from __future__ import annotations

import math

import pytest

from vime_engine.algorithms.lr_schedule import LRSchedule
from vime_engine.train.objective import lr_schedule
from vime_engine.config import build_config


def test_warmup_then_constant():
    s = LRSchedule(lr=1.0, warmup_steps=4, decay_steps=10, style="constant")
    assert [s.learning_rate(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_reaches_min_lr_and_stays():
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=0, decay_steps=4, style="linear")
    assert [s.learning_rate(k) for k in range(6)] == pytest.approx([1.0, 0.775, 0.55, 0.325, 0.1, 0.1])


def test_cosine_decay_after_warmup():
    s = LRSchedule(lr=2.0, min_lr=0.0, warmup_steps=2, decay_steps=6, style="cosine")
    assert s.learning_rate(1) == 2.0 and s.learning_rate(2) == 2.0
    assert s.learning_rate(4) == pytest.approx(1.0 + math.cos(math.pi * 0.5))  # half way: 1.0
    assert s.learning_rate(6) == pytest.approx(0.0) and s.learning_rate(9) == pytest.approx(0.0)


def test_decay_length_defaults_to_the_run_and_lr_decay_iters_wins():
    base = {"hf-checkpoint": "m", "prompt-data": "d", "rollout-batch-size": 4, "n-samples-per-prompt": 4,
            "global-batch-size": 8, "num-rollout": 10, "lr-decay-style": "linear"}
    assert lr_schedule(build_config([], **base)).decay_steps == 20  # 10 rollouts × 2 steps
    assert lr_schedule(build_config([], **base, **{"lr-decay-iters": 7})).decay_steps == 7
