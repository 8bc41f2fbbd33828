"""Megatron vs torch training backend: seconds per `train_rollout` on the same tiny Qwen3 and rollout (CPU).

Run in the Megatron lane: `.venv-megatron/bin/python bench/megatron_vs_torch.py [--repeats 5]`. Both backends
start from the same HF weights and train on the same fixed rollout in this one process; the first call of each
(warm-up) is not timed. Prints one JSON line with the medians and the ratio megatron / torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.megatron.helpers import fixed_rollout, tiny_config  # noqa: E402
from vime_engine.models.builtin import materialize_builtin_model  # noqa: E402
from vime_engine.train.megatron_backend import MegatronTrainBackend  # noqa: E402
from vime_engine.train.torch_backend import TorchTrainBackend  # noqa: E402


def seconds_per_rollout(backend, samples, repeats: int) -> list[float]:
    backend.train_rollout(samples)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.train_rollout(samples)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = materialize_builtin_model("tiny-qwen3", Path(tmp) / "tiny-qwen3")
        cfg = tiny_config(model)
        megatron = MegatronTrainBackend(cfg)
        samples = fixed_rollout(megatron.vocab_size)
        result = {"megatron_s": seconds_per_rollout(megatron, samples, args.repeats)}
        result["torch_s"] = seconds_per_rollout(TorchTrainBackend(cfg), samples, args.repeats)
    med = {k: statistics.median(v) for k, v in result.items()}
    print(json.dumps({
        "model": "tiny-qwen3 (2 layers, hidden 128)", "samples": len(samples),
        "tokens": sum(s.total_length for s in samples), "threads": 1,
        "megatron_median_s": round(med["megatron_s"], 4), "torch_median_s": round(med["torch_s"], 4),
        "ratio_megatron_over_torch": round(med["megatron_s"] / med["torch_s"], 2),
    }))


if __name__ == "__main__":
    main()
