"""A private process group for weight transfer (the trainer's rank 0 and the rollout engines) that leaves torch's
default group alone.

vLLM initialises torch.distributed's default (world) group inside the rollout process, so the transfer group
cannot be another `init_process_group`. Instead each side builds a backend object directly on a private
TCPStore (wrapped in a PrefixStore so the keys cannot collide with anyone else's) and calls its collectives
with group-local ranks. Nothing is registered globally, so neither side's default group is touched.

Rendezvous is two-step: the sender (rank 0) opens the store's server without waiting for peers and
publishes its port; every member then constructs the backend, which blocks until all have joined.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

SENDER_RANK = 0
_KEY_PREFIX = "vimeflow/weight-sync"


@dataclass(frozen=True)
class GroupAddress:
    host: str
    port: int
    world_size: int
    backend: str  # gloo | nccl | hccl: Accelerator.dist_backend


def local_host() -> str:
    """This node's address as other Ray nodes see it (falls back to the hostname's address outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def open_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store; rank 0 serves it (port 0 = any free port, read back from `.port`)."""
    return dist.TCPStore(host, port, world_size, rank == SENDER_RANK, timeout=timeout, wait_for_workers=False)


def make_backend(address: GroupAddress, store: dist.Store, rank: int, timeout: timedelta):
    """A process-group backend of `address.backend` with ranks local to this group; blocks until all joined."""
    prefixed = dist.PrefixStore(_KEY_PREFIX, store)
    name = address.backend
    if name == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, address.world_size, timeout)
    if name == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, address.world_size, options)
    # Out-of-tree backends (torch_npu registers "hccl") are constructed through torch's backend registry.
    plugin = dist.Backend._plugins.get(name.upper())
    if plugin is None:
        raise ValueError(f"weight sync: no torch.distributed backend {name!r} (is its plugin imported?)")
    return plugin.creator_fn(prefixed, rank, address.world_size, timeout)


def broadcast_(backend, tensor: torch.Tensor, root: int = SENDER_RANK) -> None:
    """In-place broadcast of `tensor` from `root` over a backend made by `make_backend`."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    backend.broadcast([tensor], options).wait()
