"""The rollout group: two vLLM engines (`--rollout-num-gpus 2`, or `--colocate` beside two trainer ranks) sample
exactly what one engine does, and every weight sync reaches both; one engine tensor parallel across two colocated
ranks' processes samples and syncs like any engine.

Real Ray actors and real vLLM on the tiny Qwen3 in fp32, in a private local cluster: one trainer rank and two
engines of one Ray CPU each. On two shared cores this shows the group is right, not that it is faster.
"""

from __future__ import annotations

import pytest
import ray
import torch

from vime_engine.config import build_config, with_overrides
from vime_engine.data.records import PromptRecord
from vime_engine.rollout.worker import train_plan
from vime_engine.devices.accelerator import CPU
from vime_engine.runtime.workers import Workers

RECORDS = [PromptRecord([{"role": "user", "content": f"What is {a} + {b}?"}], str(a + b)) for a, b in
           [(3, 4), (12, 9), (7, 21), (5, 5), (30, 2)]]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory, tiny_model, arithmetic_data):
    return build_config([], **{
        "hf-checkpoint": str(tiny_model), "prompt-data": str(arithmetic_data), "input-key": "question",
        "label-key": "answer", "apply-chat-template": True, "rollout-batch-size": 5, "n-samples-per-prompt": 4,
        "rollout-max-response-len": 12, "lr": 2e-2, "vllm-kv-cache-gb": 0.25,
        "custom-rm-path": "tests/support/tiny_task.py:digit_share",
        "output-dir": str(tmp_path_factory.mktemp("rollout-group")),
    })


def _drawn(samples) -> list[tuple]:
    return [(s.group_index, s.response_tokens, s.rollout_log_probs, s.reward, s.status) for s in samples]


def _max_gap(workers: Workers, samples) -> float:
    trainer_lp = workers.trainer.log_probs(samples)
    rollout_lp = torch.tensor([x for s in samples for x in s.rollout_log_probs])
    return (trainer_lp - rollout_lp).abs().max().item()


def _run_to_end(stream) -> list[list]:
    groups = []
    while finished := stream.advance():
        groups += finished
    return groups


def test_two_engines_sample_like_one_and_a_sync_reaches_both(cfg, cluster):
    plan = train_plan(cfg)
    with Workers(with_overrides(cfg, rollout_num_gpus=2), CPU) as workers:
        assert len(workers.rollout.engines) == 2
        workers.sync_weights(0)
        # M=1: what a group of one engine does, one engine generating every group (RolloutGroup.generate's call).
        one = ray.get(workers.rollout.engines[0].generate.remote(RECORDS, 0, 0, plan))
        two = workers.generate(RECORDS, 0, 0, plan).result()
        assert _drawn(two) == _drawn(one)  # the same tokens, log-probs and rewards, bit for bit

        # A round streamed over both engines gives the groups that generating it whole gives.
        streamed = _run_to_end(workers.stream(RECORDS, [], 0, 0, plan))
        assert _drawn(s for g in sorted(streamed, key=lambda g: g[0].group_index) for s in g) == _drawn(two)
        # Cut off after the first groups finish, the rest continue in the next round, on whichever engine.
        stream = workers.stream(RECORDS, [], 0, 0, plan)
        first, unfinished = stream.advance(), stream.abort()
        assert sorted(g[0].group_index for g in first + unfinished) == list(range(len(RECORDS)))
        rest = _run_to_end(workers.stream([], unfinished, 0, 0, plan))
        assert sorted(g[0].group_index for g in rest) == [g[0].group_index for g in unfinished]
        assert all(s.finished for g in rest for s in g)

        workers.train(two)
        assert _max_gap(workers, two) > 1e-3  # the trainer moved away from the weights the engines hold
        workers.sync_weights(1)  # one object-store put loaded by both; raises unless both report version 1
        fresh = workers.generate(RECORDS, 1, 0, plan).result()
        assert {s.weight_version for s in fresh} == {1}
        assert _max_gap(workers, fresh) <= 1e-5  # groups of both engines: each engine loaded the new weights


def test_two_colocated_ranks_each_hold_an_engine_that_samples_like_one_and_loads_every_sync(cfg, cluster):
    """--colocate with two data-parallel trainer ranks: engine i lives in rank i's actor, the pair samples what one
    engine does, and every sync loads the trained weights into both (each rank walks its own full copy)."""
    plan = train_plan(cfg)
    with Workers(with_overrides(cfg, colocate=True, actor_num_gpus_per_node=2), CPU) as workers:
        assert workers.rollout.engines == workers.trainer.actors() and len(workers.rollout.engines) == 2
        workers.sync_weights(0)
        one = ray.get(workers.rollout.engines[1].generate.remote(RECORDS, 0, 0, plan))
        two = workers.generate(RECORDS, 0, 0, plan).result()
        assert _drawn(two) == _drawn(one)

        workers.train(two)
        assert _max_gap(workers, two) > 1e-3
        workers.sync_weights(1)
        fresh = workers.generate(RECORDS, 1, 0, plan).result()
        assert {s.weight_version for s in fresh} == {1}
        assert _max_gap(workers, fresh) <= 1e-5  # groups of both engines: each rank loaded the new weights
        # Rank 0 and its engine took turns at the memory in vime's order (on CPU both stay resident, and the calls
        # stop at that seam): released for generation, engine asleep to train, its weights woken for the sync and
        # its KV cache after it, for the next generation.
        assert ray.get(workers.trainer.actors()[0].memory_calls.remote()) == [
            "trainer.release", "engine.sleep", "trainer.restore", "engine.wake_up(weights)",
            "trainer.release", "engine.wake_up(kv_cache)", "engine.sleep", "trainer.restore"]


@pytest.mark.parametrize("backend", ["torch", "fsdp"])
def test_two_colocated_ranks_share_one_tensor_parallel_engine(cfg, cluster, backend):
    """--colocate --rollout-num-gpus-per-engine 2: one vLLM engine tensor parallel across both ranks' processes
    (a shard in each); it samples deterministically, streams and aborts like any engine, and every sync loads the
    trained weights into both shards (each rank gathers the full weights, FSDP2's sharded ones included)."""
    plan = train_plan(cfg)
    placed = with_overrides(cfg, colocate=True, actor_num_gpus_per_node=2, rollout_num_gpus_per_engine=2,
                            train_backend=backend)
    with Workers(placed, CPU) as workers:
        assert len(workers.rollout.engines) == 1
        workers.sync_weights(0)
        first = workers.generate(RECORDS, 0, 0, plan).result()
        assert _drawn(workers.generate(RECORDS, 0, 0, plan).result()) == _drawn(first)
        assert _max_gap(workers, first) <= 1e-5

        stream = workers.stream(RECORDS, [], 0, 0, plan)
        done, unfinished = stream.advance(), stream.abort()
        assert sorted(g[0].group_index for g in done + unfinished) == list(range(len(RECORDS)))

        workers.train(first)
        assert _max_gap(workers, first) > 1e-3
        workers.sync_weights(1)
        fresh = workers.generate(RECORDS, 1, 0, plan).result()
        assert {s.weight_version for s in fresh} == {1}
        assert _max_gap(workers, fresh) <= 1e-5  # both shards loaded the new weights
