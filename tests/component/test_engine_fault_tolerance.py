"""Engine fault tolerance: a vLLM engine SIGKILLed in the middle of a rollout is replaced, reloaded with the
current weights and given its groups again, and the run ends on the weights of a run that was never disturbed.

Real runs of `train()` (private Ray cluster, one trainer rank, one vLLM engine, tiny Qwen3 in fp32). The kill
comes from a thread of this test: it waits until the engine's process is inside `generate` of the second rollout
(Ray titles a worker process `ray::<Class>.<method>` while it runs one) and sends it SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import psutil
from safetensors.torch import load_file

from vime_engine.config import build_config
from vime_engine.runtime.driver import train

KILLED_IN_ROLLOUT = 1


def _config(tiny_model, arithmetic_data, out, *flags):
    return build_config(list(flags), **{
        "hf-checkpoint": str(tiny_model), "prompt-data": str(arithmetic_data), "input-key": "question",
        "label-key": "answer", "apply-chat-template": True, "custom-rm-path": "tests/support/tiny_task.py:digit_share",
        "num-rollout": 2, "rollout-batch-size": 4, "n-samples-per-prompt": 4, "rollout-max-response-len": 32,
        "lr": 2e-2, "vllm-kv-cache-gb": 0.25, "output-dir": str(out / "out"), "save-hf": str(out / "hf"),
    })


class EngineKiller(threading.Thread):
    """SIGKILLs the first process of this test's Ray cluster seen running RolloutActor.generate."""

    def __init__(self):
        super().__init__(daemon=True)
        self.killed_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        me = psutil.Process(os.getpid())  # the private cluster's raylet, and so its workers, descend from us
        while not self.stop.is_set():
            for proc in me.children(recursive=True):
                try:
                    title = " ".join(proc.cmdline())
                except psutil.Error:
                    continue
                if title.startswith("ray::RolloutActor.generate"):
                    os.kill(proc.pid, signal.SIGKILL)
                    self.killed_at = time.time()
                    return
            time.sleep(0.01)


def _without_timings(history) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.startswith("perf/") and k != "rollout/engine_restarts"}
            for h in history]


def test_a_sigkilled_engine_is_restarted_and_the_run_ends_on_the_undisturbed_weights(
    tmp_path, tiny_model, arithmetic_data, caplog, cluster,
):
    caplog.set_level(logging.WARNING, logger="vime_engine.runtime.rollout_group")
    undisturbed = train(_config(tiny_model, arithmetic_data, tmp_path / "undisturbed"))

    killer = EngineKiller()

    def start_killer(rollout_id: int, _metrics) -> None:
        if rollout_id == KILLED_IN_ROLLOUT - 1:
            killer.start()

    # A health check every 2 s answered within 5 s: a generation running beside it must not count as silence.
    cfg = _config(tiny_model, arithmetic_data, tmp_path / "killed", "--use-fault-tolerance",
                  "--rollout-health-check-interval", "2", "--rollout-health-check-timeout", "5")
    try:
        killed = train(cfg, on_rollout=start_killer)
    finally:
        killer.stop.set()
    assert killer.killed_at is not None, "the engine was never seen generating in the second rollout"

    assert killed.history[KILLED_IN_ROLLOUT]["rollout/engine_restarts"] == 1  # one restart: no false alarm
    assert _without_timings(killed.history) == _without_timings(undisturbed.history)
    ours, theirs = load_file(tmp_path / "killed/hf/model.safetensors"), load_file(
        tmp_path / "undisturbed/hf/model.safetensors")
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)

    died = next(r for r in caplog.records if "died" in r.getMessage())
    back = next(r for r in caplog.records if "restarted" in r.getMessage())
    print(f"\nengine SIGKILLed → death seen: {died.created - killer.killed_at:.2f} s; "
          f"seen → new engine loaded: {back.created - died.created:.1f} s; "
          f"rollout {KILLED_IN_ROLLOUT} took {killed.history[KILLED_IN_ROLLOUT]['perf/rollout_time']:.1f} s "
          f"(undisturbed {undisturbed.history[KILLED_IN_ROLLOUT]['perf/rollout_time']:.1f} s)")
