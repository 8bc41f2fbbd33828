"""FSDP2 for the torch backend (`--train-backend fsdp`): parameters, gradients and optimizer state sharded over
the data-parallel ranks with torch's `fully_shard`, and the state moved between that layout and whole tensors.

Checkpoints, HF exports and weight syncs hold whole tensors, as the unsharded backend writes them, so a run saved
by any number of ranks, sharded or not, resumes on any other. Gathering is a collective: every rank walks the
same structure in the same order (state dicts are built the same way on every rank).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor


def shard_model(model: nn.Module, device_type: str, world_size: int) -> nn.Module:
    """`model` sharded in place: each block HF keeps whole when it splits a model over devices
    (`_no_split_modules`: the decoder layers) is one FSDP unit, the rest (embeddings, final norm, head) the root's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    units = set(_no_split_modules(model))
    for module in model.modules():
        if type(module).__name__ in units:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _no_split_modules(model: nn.Module) -> list[str]:
    names = [name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or [])]
    if not names:
        raise ValueError(f"{type(model).__name__} names no `_no_split_modules` (its decoder layers): FSDP2 needs "
                         "them to shard by layer; use --train-backend torch for this model")
    return names


def whole(tensor: Tensor) -> Tensor:
    """The whole tensor of a shard (collective), or the tensor itself when it is not sharded."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gathered(state: Any) -> Any:
    """`state` (nested dicts, lists, tensors) with every shard replaced by its whole tensor (collective)."""
    if isinstance(state, dict):
        return {key: gathered(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(gathered(value) for value in state)
    return whole(state) if isinstance(state, Tensor) else state


def sharded_like(full: Tensor, like: Tensor) -> Tensor:
    """`full` cut into this rank's shard of `like`'s layout (no communication: every rank holds `full`)."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def sharded_optimizer_state(state: dict, params: list[nn.Parameter]) -> dict:
    """An optimizer state dict of whole tensors (`Optimizer.state_dict()`'s format: parameters numbered in
    param-group order) with each per-parameter tensor of a parameter's shape cut like that parameter."""
    per_param = {
        index: {key: sharded_like(value, params[index])
                if isinstance(value, Tensor) and value.shape == params[index].shape else value
                for key, value in values.items()}
        for index, values in state["state"].items()
    }
    return {**state, "state": per_param}
