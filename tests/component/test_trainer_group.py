"""The trainer group: N torch ranks on Ray (gloo on CPU) behave as one trainer.

Ranks here are Ray actors of one CPU each in a private local cluster: two processes on a two-core machine, so
these tests show the group's correctness (placement, rendezvous, exact loss reduction, checkpoints across
layouts), not its speed (bench/trainer_group.py measures that).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import ray
import torch
from safetensors.torch import load_file

from vime_engine.checkpoint.store import CheckpointRef
from vime_engine.config import ConfigError, build_config
from vime_engine.devices.accelerator import CPU
from vime_engine.runtime.driver import train
from vime_engine.runtime.trainer_group import TrainerGroup

DP2 = {"actor-num-gpus-per-node": 2}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model, arithmetic_data):
    return tiny_model, arithmetic_data, tmp_path_factory.mktemp("trainer-group")


def _config(inputs, name: str, **flags):
    model, data, root = inputs
    return build_config([], **{
        "hf-checkpoint": str(model), "prompt-data": str(data), "input-key": "question", "label-key": "answer",
        "apply-chat-template": True, "rollout-shuffle": True, "num-rollout": 1,
        "rollout-batch-size": 4, "n-samples-per-prompt": 4, "rollout-max-response-len": 12,
        "global-batch-size": 8, "lr": 1e-2, "vllm-kv-cache-gb": 0.25, "micro-batch-size": 2,
        "custom-rm-path": "tests/support/tiny_task.py:digit_share", "output-dir": str(root / name / "out"),
        "save": str(root / name / "ckpt"), **flags,
    })


def _train(inputs, name: str, **flags) -> tuple[list[dict], dict[str, torch.Tensor], CheckpointRef]:
    result = train(_config(inputs, name, **flags))
    return result.history, load_file(result.checkpoint.path / "model.safetensors"), result.checkpoint


def test_ranks_get_their_rendezvous_environment(inputs, cluster):
    group = TrainerGroup(_config(inputs, "env", **DP2), CPU)
    env_of = lambda rank: rank.__ray_call__.remote(lambda self: {  # noqa: E731
        k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    } | {"dist": self.backend.dp.rank})
    envs = ray.get([env_of(rank) for rank in group.ranks])
    assert [(e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["dist"]) for e in envs] == [
        ("0", "2", "0", 0), ("1", "2", "1", 1)]
    assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] and envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    group.shutdown()


def test_more_nodes_than_the_cluster_has_fail_naming_the_flags(inputs, cluster):
    with pytest.raises(ConfigError, match="--actor-num-nodes 2 .*1 node"):
        TrainerGroup(_config(inputs, "too-many", **{"actor-num-nodes": 2}), CPU)


# Adam normalises each gradient element, so an element near zero whose fp32 rounding differs between two
# runs moves by a sizeable share of lr either way (seen here: 7e-5 at lr 1e-2 while every loss and the gradient
# norm agree to 1e-7): the learning rates below keep that under the tolerance, still far above RL's usual 1e-6.
# With one sample per micro-batch both runs compute the same per-sample shapes and only the cross-rank sum
# differs; with a token budget the ranks pack other micro-batches than one rank does (other padding, other matmul
# shapes), so a smaller lr keeps the rounding's effect under the tolerance.
# FSDP2 (`--train-backend fsdp`) with a token budget: the ranks' shares pack into different numbers of
# micro-batches, and every sharded forward and backward is a collective, so the ranks even them out.
TOKEN_BUDGET = {"use-dynamic-batch-size": True, "max-tokens-per-gpu": 96, "lr": 1e-4}


@pytest.fixture(scope="module")
def one_rank_runs(inputs) -> Callable[[dict], tuple[list[dict], dict[str, torch.Tensor], CheckpointRef]]:
    """One rank's run per batching, shared by the two-rank variants it is compared with."""
    runs: dict = {}

    def run(batching: dict) -> tuple[list[dict], dict[str, torch.Tensor], CheckpointRef]:
        key = tuple(sorted(batching.items()))
        if key not in runs:
            runs[key] = _train(inputs, "dp1-" + "-".join(f"{k}{v}" for k, v in batching.items()), **batching)
        return runs[key]

    return run


@pytest.mark.parametrize("backend, batching", [
    ("torch", {"micro-batch-size": 1, "lr": 1e-3}),
    ("torch", TOKEN_BUDGET),
    ("fsdp", TOKEN_BUDGET),
], ids=["micro-batches", "token-budget", "fsdp-token-budget"])
def test_two_data_parallel_ranks_update_like_one(inputs, cluster, one_rank_runs, backend, batching):
    name = "-".join(f"{k}{v}" for k, v in batching.items())
    one_history, one, _ = one_rank_runs(batching)
    two_history, two, _ = _train(inputs, f"dp2-{backend}-{name}", **DP2, **batching, **{"train-backend": backend})
    initial = load_file(inputs[0] / "model.safetensors")
    assert one.keys() == two.keys()
    moved = max((one[k] - initial[k]).abs().max().item() for k in one if k in initial)
    assert moved > 10 * 1e-5  # the two optimizer steps moved the weights: the comparison below means something
    train_metrics = "\n".join(f"{k}: {one_history[0][k]} {two_history[0][k]}"
                              for k in one_history[0] if k.startswith("train"))
    assert max((one[k] - two[k]).abs().max().item() for k in one) <= 1e-5, train_metrics
    for key in ("train/pg_loss", "train/grad_norm", "train/entropy_loss", "rollout/raw_reward"):
        assert two_history[0][key] == pytest.approx(one_history[0][key], rel=1e-4, abs=1e-6), key
    # The gathered log-probs of the two ranks' shares are exactly those vLLM sampled with.
    assert two_history[0]["train/train_rollout_logprob_abs_diff"] <= 1e-5


def test_sharded_ranks_hold_half_the_state_and_load_and_save_one_ranks_checkpoint_unchanged(
        inputs, cluster, one_rank_runs, tmp_path):
    *_, saved = one_rank_runs(TOKEN_BUDGET)  # a one-rank checkpoint with Adam's moments
    group = TrainerGroup(_config(inputs, "fsdp-state", **DP2, **{"train-backend": "fsdp"}), CPU)
    group.load_state(str(saved.path), saved.manifest.files)

    def held(backend) -> tuple[bool, int, int]:
        """Whether every parameter is a shard, and the elements of this rank's parameters and Adam moments."""
        from torch.distributed.tensor import DTensor

        params = list(backend.model.parameters())
        moments = [t for state in backend.optimizer.state.values() for t in state.values() if t.dim() > 0]
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        return (all(isinstance(p, DTensor) for p in params),
                sum(local(p).numel() for p in params), sum(local(t).numel() for t in moments))

    (sharded0, params0, moments0), (sharded1, params1, moments1) = ray.get(
        [rank.__ray_call__.remote(lambda self: held(self.backend)) for rank in group.ranks])
    total = sum(t.numel() for t in load_file(saved.path / "model.safetensors").values())
    assert sharded0 and sharded1
    assert params0 + params1 == total and abs(params0 - params1) <= 0.01 * total  # each rank a half
    assert moments0 + moments1 == 2 * total  # Adam's two moments, sharded like their parameters

    group.save_state(str(tmp_path))  # gathered back into whole tensors
    group.shutdown()
    for name in ("model.safetensors", "trainer.safetensors"):
        before, after = load_file(saved.path / name), load_file(tmp_path / name)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), name
