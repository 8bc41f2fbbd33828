"""Weight sync from the trainer actor to the rollout actor: object store and bucketed gloo broadcast.

Real Ray actors, real vLLM, the tiny Qwen3 in fp32. The check is the one RL depends on: after a training step
and a sync, the log-probs vLLM reports for the tokens it sampled equal the trainer's log-probs of the same
tokens; before the sync they do not (so a sync that silently did nothing fails the test).
"""

from __future__ import annotations

import ray
import torch
import pytest

from vime_engine.config import build_config, with_overrides
from vime_engine.data.records import PromptRecord
from vime_engine.rollout.worker import train_plan
from vime_engine.devices.accelerator import CPU
from vime_engine.runtime.workers import Workers
from vime_engine.weight_sync.buckets import TensorSpec, flatten, plan_buckets, unflatten

RECORDS = [PromptRecord([{"role": "user", "content": f"What is {a} + {b}?"}], str(a + b)) for a, b in
           [(3, 4), (12, 9), (7, 21), (5, 5)]]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory, tiny_model, arithmetic_data):
    root = tmp_path_factory.mktemp("weight-sync")
    return build_config([], **{
        "hf-checkpoint": str(tiny_model), "prompt-data": str(arithmetic_data), "input-key": "question",
        "label-key": "answer", "apply-chat-template": True, "rollout-batch-size": 4, "n-samples-per-prompt": 4,
        "rollout-max-response-len": 12, "lr": 2e-2, "vllm-kv-cache-gb": 0.25,
        "custom-rm-path": "tests/support/tiny_task.py:digit_share", "output-dir": str(root / "run"),
    })


def _max_gap(workers: Workers, samples) -> float:
    trainer_lp = workers.trainer.log_probs(samples)
    rollout_lp = torch.tensor([x for s in samples for x in s.rollout_log_probs])
    return (trainer_lp - rollout_lp).abs().max().item()


@pytest.mark.parametrize("kind", ["object_store", "broadcast"])
def test_sync_makes_rollout_log_probs_match_trainer(cfg, cluster, kind):
    with Workers(with_overrides(cfg, weight_sync=kind, colocate=False), CPU) as workers:
        assert workers.weight_sync.kind == kind
        plan = train_plan(cfg)
        workers.sync_weights(0)
        first = workers.generate(RECORDS, 0, 0, plan).result()
        assert _max_gap(workers, first) <= 1e-5  # version 0: both ends hold the checkpoint

        workers.train(first)
        stale = workers.generate(RECORDS, 1, 0, plan).result()
        assert {s.weight_version for s in stale} == {0}
        assert _max_gap(workers, stale) > 1e-3  # trainer moved, engine did not

        for version in (1, 2):  # a second sync exercises the already-formed group
            workers.sync_weights(version)
            fresh = workers.generate(RECORDS, 1 + version, 0, plan).result()
            assert {s.weight_version for s in fresh} == {version}
            assert _max_gap(workers, fresh) <= 1e-5
            if version == 1:
                workers.train(fresh)


def test_bucket_plan_respects_size_and_dtype_and_round_trips():
    tensors = {
        "a": torch.randn(10, 10), "b": torch.randn(300), "c": torch.randn(5).to(torch.bfloat16),
        "d": torch.randn(50), "e": torch.randn(2000), "f": torch.randn(3).to(torch.bfloat16),
    }
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    plan = plan_buckets(specs, bucket_bytes=1600)
    for bucket in plan:
        assert {s.dtype for s in bucket.specs} == {bucket.dtype}
        assert bucket.nbytes <= 1600 or len(bucket.specs) == 1  # only an oversized tensor travels alone
    assert sorted(s.name for b in plan for s in b.specs) == sorted(tensors)
    assert [s.name for b in plan for s in b.specs if s.dtype == torch.float32] == ["a", "b", "d", "e"]
    for bucket in plan:
        for name, view in unflatten(bucket, flatten(bucket, tensors, torch.device("cpu"))):
            assert torch.equal(view, tensors[name])
