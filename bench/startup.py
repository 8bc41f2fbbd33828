"""Start-up of a run: seconds from `vimeflow train` to its first rollout and to its exit, on the tiny model, against
the floor every run pays (a fresh Python process importing vLLM, as the engine's actor must).

Most of a short run is start-up (the driver's imports and checks, Ray, the actor's imports, the model and the
engine), and every test that starts a run pays it, so this is the figure to watch for CI time too. Each repeat
runs the floor and the run back to back; the medians and their ratio are printed.

    .venv/bin/python bench/startup.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def vllm_import_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from vllm import LLM"], check=True, capture_output=True)
    return time.perf_counter() - t0


def run_seconds(config: Path) -> tuple[float, float]:
    """(seconds to the first rollout's progress line, seconds to exit) of one `vimeflow train`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "--config", str(config)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = None
    for line in proc.stdout:
        if first is None and line.startswith("rollout "):
            first = time.perf_counter() - t0
    assert proc.wait() == 0 and first is not None, "the run failed"
    return first, time.perf_counter() - t0


def main() -> None:
    import yaml

    from vime_engine.data.synthetic import materialize_builtin_dataset
    from vime_engine.models.builtin import materialize_builtin_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vimeflow-startup-") as tmp:
        tmp = Path(tmp)
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump({
            "hf-checkpoint": str(materialize_builtin_model("tiny-qwen3", tmp / "tiny-qwen3")),
            "prompt-data": str(materialize_builtin_dataset("arithmetic", tmp / "data")),
            "input-key": "question", "label-key": "answer", "apply-chat-template": True,
            "num-rollout": 1, "rollout-batch-size": 4, "n-samples-per-prompt": 4, "rollout-max-response-len": 8,
            "vllm-kv-cache-gb": 0.25, "output-dir": str(tmp / "out"),
        }))
        floors, firsts, totals = [], [], []
        for i in range(args.repeat):
            floors.append(vllm_import_seconds())
            first, total = run_seconds(config)
            firsts.append(first)
            totals.append(total)
            print(f"repeat {i}: import vLLM {floors[-1]:.1f} s | first rollout {first:.1f} s | exit {total:.1f} s",
                  flush=True)
    floor, first, total = (statistics.median(x) for x in (floors, firsts, totals))
    print(f"\nmedians of {args.repeat} (cores: {os.cpu_count()}):")
    print("| import vLLM (floor) | to first rollout | to exit | exit / floor |")
    print("|---|---|---|---|")
    print(f"| {floor:.1f} s | {first:.1f} s | {total:.1f} s | {total / floor:.2f}x |")


if __name__ == "__main__":
    main()
