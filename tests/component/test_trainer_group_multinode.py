"""A trainer group across two Ray nodes: Ray's own multi-node test cluster (two raylets on 127.0.0.1, one CPU
"device" each), token authentication on as Ray 2.60 requires, `--actor-num-nodes 2` placing one rank per node.

Ray reads its settings when it is imported, so the cluster and the driver run in a fresh process
(`python -m tests.component.test_trainer_group_multinode`) with the token in its environment and Ray's loopback
mode on (vime_engine.runtime.cluster): without it the driver turns 127.0.0.1 into the machine's interface
address, where the test cluster does not listen.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import ray
import torch

from tests.support.multinode import run_module_on_a_local_cluster
from vime_engine.config import build_config
from vime_engine.models.builtin import materialize_builtin_model
from vime_engine.runtime.devices import CPU
from vime_engine.runtime.trainer_group import TrainerGroup
from vime_engine.sample import Sample


def _samples(vocab: int) -> list[Sample]:
    rng = random.Random(1)
    responses = [[rng.randrange(10, vocab) for _ in range(rng.randrange(3, 9))] for _ in range(8)]
    return [Sample(i // 4, "", "", [rng.randrange(10, vocab) for _ in range(12)], response,
                   loss_mask=[1] * len(response), reward=i % 2)
            for i, response in enumerate(responses)]


def test_one_rank_per_node_trains_in_step():
    stdout = run_module_on_a_local_cluster("tests.component.test_trainer_group_multinode", timeout=300)
    assert "one rank per node, in step" in stdout


def check_one_rank_per_node_trains_in_step(model: Path) -> None:
    cfg = build_config([], **{"hf-checkpoint": str(model), "prompt-data": "unused", "rollout-batch-size": 2,
                              "n-samples-per-prompt": 4, "lr": 1e-3, "actor-num-nodes": 2})
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


if __name__ == "__main__":
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
    try:
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        check_one_rank_per_node_trains_in_step(materialize_builtin_model("tiny-qwen3", Path(tempfile.mkdtemp())))
    finally:
        ray.shutdown()
        cluster.shutdown()
