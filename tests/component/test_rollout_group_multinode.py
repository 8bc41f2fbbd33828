"""The rollout group across Ray nodes: three raylets on 127.0.0.1 with one CPU "device" each, the trainer on one,
two engines (`--rollout-num-gpus 2`) on the other two; the broadcast weight sync crosses the nodes.

As in test_trainer_group_multinode.py, Ray reads its settings when it is imported, so the cluster and the driver
run in a fresh process (one for both files, tests.support.multinode) with the auth token in its environment and
Ray's loopback mode on.
"""

from __future__ import annotations

from pathlib import Path

import ray
import torch

from vime_engine.config import ConfigError, build_config
from vime_engine.data.records import PromptRecord
from vime_engine.rollout.worker import train_plan
from vime_engine.devices.accelerator import CPU
from vime_engine.runtime.workers import Workers

RECORDS = [PromptRecord([{"role": "user", "content": f"What is {a} + {b}?"}], str(a + b)) for a, b in
           [(3, 4), (12, 9), (7, 21), (5, 5)]]
NODES = 3  # the trainer and each engine on a node of its own


def test_engines_on_their_own_nodes_load_every_sync(multinode_checks):
    printed = multinode_checks[Path(__file__).stem]
    assert "trainer and engines on three nodes, in sync" in printed, printed


def test_a_run_whose_files_some_node_lacks_is_refused_naming_the_nodes(multinode_checks):
    printed = multinode_checks[Path(__file__).stem]
    assert "a directory missing on the nodes is refused before placement" in printed, printed


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def multinode_check(model: Path, output: Path) -> None:
    cfg = build_config([], **{"hf-checkpoint": str(model), "prompt-data": "unused", "apply-chat-template": True,
                              "rollout-batch-size": 4, "n-samples-per-prompt": 4, "rollout-max-response-len": 12,
                              "lr": 2e-2, "vllm-kv-cache-gb": 0.25, "rollout-num-gpus": 2,
                              "weight-sync": "broadcast", "output-dir": str(output)})
    plan = train_plan(cfg)
    with Workers(cfg, CPU) as workers:
        nodes = [_node_of(actor) for actor in [workers.trainer.leader, *workers.rollout.engines]]
        assert len(set(nodes)) == 3, nodes  # one CPU a node: the trainer and each engine on a node of its own
        workers.sync_weights(0)
        samples = workers.generate(RECORDS, 0, 0, plan).result()
        workers.train(samples)
        workers.sync_weights(1)  # one broadcast from the trainer's node to both engines' nodes
        fresh = workers.generate(RECORDS, 1, 0, plan).result()
        trainer_lp = workers.trainer.log_probs(fresh)
        gap = (trainer_lp - torch.tensor([x for s in fresh for x in s.rollout_log_probs])).abs().max().item()
        assert {s.weight_version for s in fresh} == {1} and gap <= 1e-5, gap
    print("trainer and engines on three nodes, in sync")
    unshared = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"load": "/no/such/ckpt"})})
    try:
        Workers(unshared, CPU)
    except ConfigError as refused:  # asked of every node, each named
        assert str(refused).count("lacks --load /no/such/ckpt") == NODES, refused
        print("a directory missing on the nodes is refused before placement")
