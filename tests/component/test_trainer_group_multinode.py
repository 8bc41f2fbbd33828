"""A trainer group across two Ray nodes: Ray's own multi-node test cluster (raylets on 127.0.0.1, one CPU
"device" each), token authentication on as Ray 2.60 requires, `--actor-num-nodes 2` placing one rank per node.

Ray reads its settings when it is imported, so the cluster and the driver run in a fresh process (shared with
test_rollout_group_multinode.py, tests.support.multinode) with the token in its environment and Ray's loopback
mode on (vime_engine.runtime.cluster): without it the driver turns 127.0.0.1 into the machine's interface
address, where the test cluster does not listen.
"""

from __future__ import annotations

import random
from pathlib import Path

import ray
import torch

from vime_engine.config import build_config
from vime_engine.devices.accelerator import CPU
from vime_engine.runtime.trainer_group import TrainerGroup
from vime_engine.sample import Sample

NODES = 2  # one rank on each


def _samples(vocab: int) -> list[Sample]:
    rng = random.Random(1)
    responses = [[rng.randrange(10, vocab) for _ in range(rng.randrange(3, 9))] for _ in range(8)]
    return [Sample(i // 4, "", "", [rng.randrange(10, vocab) for _ in range(12)], response,
                   loss_mask=[1] * len(response), reward=i % 2)
            for i, response in enumerate(responses)]


def test_one_rank_per_node_trains_in_step(multinode_checks):
    printed = multinode_checks[Path(__file__).stem]
    assert "one rank per node, in step" in printed, printed


def multinode_check(model: Path, output: Path) -> None:
    cfg = build_config([], **{"hf-checkpoint": str(model), "prompt-data": "unused", "rollout-batch-size": 2,
                              "n-samples-per-prompt": 4, "lr": 1e-3, "actor-num-nodes": 2,
                              "output-dir": str(output)})
    group = TrainerGroup(cfg, CPU)
    try:
        placed = ray.get([rank.__ray_call__.remote(
            lambda self: (ray.get_runtime_context().get_node_id(), self.rank, self.backend.dp.size))
            for rank in group.ranks])
        assert len({node for node, _, _ in placed}) == 2  # the ranks are on different nodes
        assert [(rank, size) for _, rank, size in placed] == [(0, 2), (1, 2)]

        samples = _samples(int(ray.get(group.leader.__ray_call__.remote(
            lambda self: self.backend.model.config.vocab_size))))
        log_probs = group.log_probs(samples)
        offset = 0
        for s in samples:
            s.rollout_log_probs = log_probs[offset:offset + s.response_length].tolist()
            offset += s.response_length
        metrics = group.train(samples)
        assert metrics["train/grad_norm"] > 0
        # Both ranks took the same step: the gradients were all-reduced across the nodes.
        first, second = ray.get([rank.__ray_call__.remote(
            lambda self: torch.cat([p.detach().flatten() for p in self.backend.model.parameters()]))
            for rank in group.ranks])
        assert torch.equal(first, second)
    finally:
        group.shutdown()
    print("one rank per node, in step")

