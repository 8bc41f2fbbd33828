"""The machine's speed right now, timed in the engine process beside the step times a chunk logs.

The nightly gate (tasks/regression.py) compares step time as a ratio to this reference, so a slower or busier
machine does not read as a regression of the code.
"""

from __future__ import annotations

import statistics
import time


def reference_seconds(repeats: int = 3) -> float:
    """Median time of a fixed small torch forward+backward: the machine's speed right now."""
    import torch

    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    x = torch.randn(64, 256, generator=gen)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(5):
            layer(x).square().mean().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
