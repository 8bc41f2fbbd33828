"""One rank of the TP=2 test: `python -m tests.megatron.tp_worker RANK WORLD PORT MODEL_DIR OUT_FILE`.

Each rank builds the backend with --tensor-model-parallel-size 2 over gloo, computes
log-probs, trains one rollout, and iterates the HF weight stream (collective); rank 0 saves the results.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def main(rank: int, world: int, port: int, model_dir: Path, out_file: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from tests.megatron.helpers import fixed_rollout, tiny_config
    from vime_engine.train.megatron_backend import MegatronTrainBackend

    backend = MegatronTrainBackend(tiny_config(model_dir, **{"tensor-model-parallel-size": world,
                                                         "actor-num-gpus-per-node": world}))
    samples = fixed_rollout(backend.vocab_size)
    before = backend.log_probs(samples)
    metrics = backend.train_rollout(samples)
    weights = {name: tensor.clone() for name, tensor in backend.named_weights()}
    shard = dict(backend.model[0].module.named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"].shape
    if rank == 0:
        torch.save({"log_probs": before, "metrics": metrics, "weights": weights, "fc1_shard": tuple(shard)}, out_file)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
