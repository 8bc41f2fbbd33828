"""The whole RL loop on Ray with real vLLM and the torch trainer: colocated, disaggregated, async.

In synchronous modes every rollout is generated right after a weight sync, so the trainer's log-probs of the
sampled tokens must equal vLLM's (fp32): `train/train_rollout_logprob_abs_diff` is that gap. In async mode
rollout i+1 is generated under the weights before training on rollout i, so the gap is real there; the check
is that the loop runs, overlaps, and keeps its versions straight. With partial rollout, responses cut off in
one rollout are finished in the next under newer weights: each token's rollout log-prob must be that of the
weights its segment records.

The server-mode run is `vimeflow train` itself, disturbed twice: one of its two `vllm serve` engines is SIGKILLed
in the middle of rollout 1 (fault tolerance replaces it, `ServerKiller`), and the whole run is SIGKILLed in
rollout 2's generation and resumed from its checkpoint of rollout 1 (tests/support/killed_runs.py); it must still
end on the in-process run's weights, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest
import ray
import torch
import yaml

from tests.support.killed_runs import REPO, kill_run, run_train, start_train
from vime_engine.checkpoint.store import find_latest
from vime_engine.config import build_config
from vime_engine.runtime.driver import train
from vime_engine.runtime.workers import Workers
from vime_engine.train.objective import response_log_probs

NUM_ROLLOUT = 3


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model, arithmetic_data):
    return tiny_model, arithmetic_data, tmp_path_factory.mktemp("engine-loop")


def _flags(inputs, name: str, **flags) -> dict:
    model, data, root = inputs
    return {
        "hf-checkpoint": str(model), "prompt-data": str(data), "input-key": "question", "label-key": "answer",
        "apply-chat-template": True, "rollout-shuffle": True, "num-rollout": NUM_ROLLOUT,
        "rollout-batch-size": 4, "n-samples-per-prompt": 4, "rollout-max-response-len": 12,
        "global-batch-size": 8, "lr": 1e-2, "vllm-kv-cache-gb": 0.25,
        "custom-rm-path": str(REPO / "tests/support/tiny_task.py") + ":digit_share", "output-dir": str(root / name),
        **flags,
    }


def _run(inputs, name: str, **flags):
    """A run in this process (on the module's Ray cluster): its history and metrics file."""
    result = train(build_config([], **_flags(inputs, name, **flags)))
    assert result.rollouts_done == list(range(NUM_ROLLOUT))
    return result.history, inputs[2] / name / "metrics.jsonl"


def _run_disturbed(inputs, name: str, **flags):
    """`vimeflow train` with a server SIGKILLed in rollout 1's generation (the dispatcher pauses as it submits
    rollout 1, its second round, while the ServerKiller stops the server), then the whole run SIGKILLed once its
    checkpoint of rollout 1 is in (in rollout 2), and resumed: its history (the metrics file, which the resume cut
    back to its checkpoint), metrics file and ServerKiller."""
    run_dir = inputs[2] / name
    run_dir.mkdir(parents=True)
    config = run_dir / "config.yaml"
    config.write_text(yaml.safe_dump(_flags(inputs, name, **{"save": str(run_dir / "ckpt"), "save-interval": 1},
                                            **flags)))
    metrics = run_dir / "metrics.jsonl"
    proc, paused = start_train(config, victim="pause", fault="vime_engine.rollout.server.router_engine:"
                               f"RouterEngine.submit:{SERVER_KILLED_IN_ROLLOUT + 1}")
    killer = ServerKiller(paused)
    killer.start()
    try:
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline and (
                (latest := find_latest(run_dir / "ckpt")) is None or latest.rollout_id < 1):
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before its checkpoint of rollout 1; see {run_dir / 'log.txt'}"
        kill_run(proc, paused)
    finally:
        killer.stop.set()
        if proc.poll() is None:
            kill_run(proc, paused)
    assert find_latest(run_dir / "ckpt").rollout_id == 1 and len(metrics.read_text().splitlines()) == 2
    assert run_train(config, timeout=600) == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()], metrics, killer


PLACEMENTS = {
    "colocated": {"colocate": True},
    "disaggregated": {"colocate": False},
    # Two engines (the rollout group): each sync is one broadcast to both, each rollout spread over both.
    "two-engines-broadcast": {"weight-sync": "broadcast", "rollout-num-gpus": 2},
    # vime's layout: two `vllm serve` engines behind a vllm-router, every request posted to the router; one is
    # SIGKILLed mid-rollout and replaced (round robin gives both servers requests to lose; health checks every 2 s),
    # and the run is killed and resumed (`_run_disturbed`).
    "two-servers-behind-a-router": {"rollout-mode": "server", "rollout-num-gpus": 2, "router-policy": "round_robin",
                                    "use-fault-tolerance": True, "rollout-health-check-interval": 2,
                                    "rollout-health-check-timeout": 5},
}
SERVER_KILLED_IN_ROLLOUT = 1  # in its generation: the dispatcher's round (RouterEngine.submit call) 2
EXPORTED = ("two-engines-broadcast", "two-servers-behind-a-router")  # compared by the test after the loop's


@pytest.fixture(scope="module")
def runs(inputs):
    """Each placement's run, made once for the tests that read it: its history and metrics file (and the server
    run's ServerKiller, `runs.killer`)."""
    made = {}

    def run(name: str):
        if name not in made:
            made[name] = None  # a run that fails is not made again for the next test
            extra = {"save-hf": str(inputs[2] / name / "hf")} if name in EXPORTED else {}
            if PLACEMENTS[name].get("use-fault-tolerance"):
                *made[name], run.killer = _run_disturbed(inputs, name, **PLACEMENTS[name], **extra)
            else:
                made[name] = _run(inputs, name, **PLACEMENTS[name], **extra)
        if made[name] is None:
            pytest.fail(f"the {name} run failed in an earlier test")
        return made[name]

    return run


class ServerKiller(threading.Thread):
    """When the run's dispatcher pauses in rollout 1's submit (`paused` appears), stops (SIGSTOP) one of the run's
    `vllm serve` processes and lets the dispatcher go on, so that the requests the router sends that server are in
    flight when, a second later, it is SIGKILLed; then watches the run's router until the killed server has left its
    worker list and a new one has joined. The run's processes descend from this test's process."""

    def __init__(self, paused: Path):
        super().__init__(daemon=True)
        self.paused = paused
        self.stop = threading.Event()
        self.killed_at = self.removed_at = self.joined_at = None
        self.killed_url, self.group, self.error = None, [], None

    def run(self) -> None:
        try:
            self._kill_and_watch()
        except Exception as error:  # shown by the test's assertion
            self.error = repr(error)

    def _kill_and_watch(self) -> None:
        while not self.stop.is_set() and not self.paused.exists():
            time.sleep(0.01)
        servers = [p for p in _ours() if _unguarded(p, "vllm.entrypoints.openai.api_server")]
        router = next(p for p in _ours() if "vllm-router" in _cmdline(p))  # its guard (the router retitles itself)
        victim = servers[0]
        self.killed_url = f"http://127.0.0.1:{_flag(victim, '--port')}"
        self.group = [p for p in psutil.process_iter() if _group(p) == victim.pid]  # the server and its engine core
        router_url = f"http://127.0.0.1:{_flag(router, '--port')}"
        before = set(httpx.get(router_url + "/list_workers").json()["urls"])
        os.kill(victim.pid, signal.SIGSTOP)
        self.paused.with_name(self.paused.name + ".resume").touch()
        time.sleep(1)
        os.kill(victim.pid, signal.SIGKILL)
        self.killed_at = time.time()
        while not self.stop.is_set() and self.joined_at is None:
            with contextlib.suppress(httpx.HTTPError):
                workers = set(httpx.get(router_url + "/list_workers", timeout=5).json()["urls"])
                if self.removed_at is None and self.killed_url not in workers:
                    self.removed_at = time.time()
                if self.removed_at is not None and workers - before:
                    self.joined_at = time.time()
            time.sleep(0.1)


def _ours() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def _cmdline(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return " ".join(process.cmdline())
    return ""


def _unguarded(process: psutil.Process, program: str) -> bool:
    """`process` runs `program` (its guard, whose command line names it too, does not)."""
    words = _cmdline(process).split()
    return any(word.endswith(program) for word in words) and not any("server_guard" in word for word in words)


def _flag(process: psutil.Process, flag: str) -> str:
    words = process.cmdline()
    return words[words.index(flag) + 1]


def _group(process: psutil.Process) -> int | None:
    with contextlib.suppress(OSError):
        return os.getpgid(process.pid)
    return None


@pytest.mark.parametrize("name", PLACEMENTS)
def test_synchronous_loop_trains_on_exactly_the_rollout_policy(runs, cluster, name):
    history, metrics_path = runs(name)
    assert [row["rollout_id"] for row in history] == list(range(NUM_ROLLOUT))
    for row in history:
        assert row["train/train_rollout_logprob_abs_diff"] <= 1e-5, row
        assert row["weight_version"] == row["rollout_id"] + 1
        assert row["train/grad_norm"] > 0  # the optimizer moved the weights, so each sync carried news
    logged = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert len(logged) == NUM_ROLLOUT


def test_server_engines_behind_the_router_train_the_weights_of_in_process_engines(runs, inputs, cluster):
    from safetensors.torch import load_file

    (in_process, _), (served, _) = runs(EXPORTED[0]), runs(EXPORTED[1])
    math = ("rollout/raw_reward", "train/pg_loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff")
    assert [[row[k] for k in math] for row in served] == [[row[k] for k in math] for row in in_process]
    weights = [load_file(next((inputs[2] / name / "hf").glob("*.safetensors"))) for name in EXPORTED]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # the HF exports, bit for bit
    assert not _servers_left(), "a vllm serve or vllm-router process outlived its run"

    # ... although one server was SIGKILLed in rollout 1 (the router stopped sending it work, a new server joined it,
    # nothing of the killed one, its engine core included, outlived it, and the run restarted one engine), and the
    # run itself was killed in rollout 2 and resumed (its rollout 2 comes from the resumed process)
    killer = runs.killer
    assert killer.killed_at is not None, f"no server was killed: {killer.error}"
    death = re.search(r"died \(ServerDied: the server \S+ exited with code -?\d+ \(its log: (\S+)\)\)",
                      (inputs[2] / EXPORTED[1] / "log.txt").read_text())  # seen exiting while generating
    assert death is not None and Path(death.group(1)).is_file()
    assert killer.removed_at is not None and killer.joined_at is not None, "the router's workers did not change"
    assert len(killer.group) >= 2  # the server and vLLM's engine core
    assert not [p for p in killer.group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert [row.get("rollout/engine_restarts", 0) for row in served] == [0, 1, 0]
    # every server's log among the run's: the killed one's kept beside its replacement's (`NAME.2.log`), the resumed
    # process's beside the first's
    starts = Counter(p.name.split(".")[0] for p in (inputs[2] / EXPORTED[1] / "logs").glob("vllm-*.log"))
    assert starts.pop("vllm-router") == 2 and sorted(starts.values()) == [2, 3], starts
    print(f"\nserver SIGKILLed → removed from the router: {killer.removed_at - killer.killed_at:.1f} s; → a new "
          f"server joined: {killer.joined_at - killer.killed_at:.1f} s; rollout {SERVER_KILLED_IN_ROLLOUT} took "
          f"{served[SERVER_KILLED_IN_ROLLOUT]['perf/rollout_time']:.1f} s")


def _servers_left() -> list[str]:
    return [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])
            if any("vllm.entrypoints.openai.api_server" in part or part.endswith("vllm-router")
                   or part.startswith("vllm::router")  # the router's own title
                   for part in p.info["cmdline"] or [])]


def test_async_loop_runs_one_step_off_policy(inputs, cluster):
    history, _ = _run(inputs, "async", **{"async-rollout": True})
    gaps = [row["train/train_rollout_logprob_abs_diff"] for row in history]
    assert gaps[0] <= 1e-5  # rollout 0 was generated from the synced initial weights
    assert all(gap > 1e-5 for gap in gaps[1:])  # later rollouts overlapped training: one version stale


# The random tiny model rarely emits EOS, so responses end at --rollout-max-response-len or, for long prompts
# (19 to 77 tokens here), earlier at --vllm-max-model-len: groups finish at different steps and the 2 kept
# first leave the rest of the 6 generating, to be cut off.
PARTIAL = {"partial-rollout": True, "rollout-batch-size": 2, "over-sampling-batch-size": 6,
           "rollout-max-response-len": 32, "vllm-max-model-len": 88, "use-tis": True}


def test_partial_rollout_finishes_cut_off_groups_in_the_next_rollout_under_new_weights(inputs, cluster, monkeypatch):
    trained = []  # per rollout: the samples and the trainer's weights they were trained from (that version)
    original_train = Workers.train

    def recording_train(self, samples):
        trained.append((samples, self.trainer.weights()))
        return original_train(self, samples)

    monkeypatch.setattr(Workers, "train", recording_train)
    history, _ = _run(inputs, "partial", **PARTIAL)
    aborted = [row["rollout/aborted_groups"] for row in history]
    resumed = [row["rollout/resumed_groups"] for row in history]
    print(f"aborted groups per rollout {aborted}, resumed {resumed}, "
          f"mixed-version samples {[row['rollout/mixed_version_samples'] for row in history]}")
    assert resumed[0] == 0 and aborted[0] > 0 and resumed[1] == aborted[0]  # cut off in 0, continued in 1
    assert max(row["rollout/mixed_version_samples"] for row in history) > 0
    assert max(row["rollout/max_staleness"] for row in history) >= 1
    assert all(row["train/grad_norm"] > 0 for row in history)  # --use-tis trained on the mixed samples

    model = _tiny_policy(inputs[0])
    mixed = 0
    for version, (samples, _) in enumerate(trained):
        for s in samples:
            assert s.response_length <= PARTIAL["rollout-max-response-len"]
            assert len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length
            assert sum(n for _, n in s.version_segments) == s.response_length
            versions = [v for v, _ in s.version_segments]
            assert versions == sorted(set(versions)) and versions[-1] <= version
            mixed += len(versions) > 1
            start = 0
            for v, n in s.version_segments:  # each segment's log-probs are those of the weights it records
                model.load_state_dict(trained[v][1])
                expected = _log_probs(model, s)[start:start + n]
                assert torch.allclose(torch.tensor(s.rollout_log_probs[start:start + n]), expected, atol=1e-5)
                start += n
    assert mixed > 0


def _tiny_policy(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


@torch.no_grad()
def _log_probs(model, sample) -> torch.Tensor:
    ids = torch.tensor([sample.prompt_tokens + sample.response_tokens])
    logits = model(input_ids=ids).logits[0, len(sample.prompt_tokens) - 1:-1]
    return response_log_probs(logits, torch.tensor(sample.response_tokens), temperature=1.0)
