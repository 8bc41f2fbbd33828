"""Reserving devices on Ray for the trainer group and the rollout group: bundles, actor resources, placement.

A "device" is one GPU / NPU (with one CPU beside it), or on CPU one of Ray's logical CPUs. Both groups reserve
their devices in a placement group first, so a cluster that cannot hold them fails at once naming the flags,
instead of leaving actors pending forever.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from vime_engine.config import ConfigError, EngineConfig
from vime_engine.devices.accelerator import Accelerator

PLACEMENT_TIMEOUT_S = 120


def colocate_by_default(cfg: EngineConfig, device_kind: str) -> bool:
    """What `--colocate auto` decides: rank i and engine i in one actor on a CPU run of one node with the torch or
    fsdp backend (bench/step_time.py: SmolLM2 in 0.74x the time per rollout of the disaggregated placement, the
    sync in process instead of through the object store), unless a flag needs the engine on an actor of its own. On
    accelerators the two would share a device's memory, which our engines do not hand back between rollouts."""
    p, r = cfg.placement, cfg.rollout
    return (device_kind == "cpu" and p.ray_address is None and p.actor_num_nodes == 1
            and cfg.train.train_backend != "megatron" and p.weight_sync == "object_store"
            and not p.async_rollout and not r.use_fault_tolerance and p.rollout_mode != "server"
            and r.rollout_num_gpus in (None, cfg.trainer_world_size) and r.rollout_num_gpus_per_engine == 1)


def with_placement_decided(cfg: EngineConfig, device_kind: str) -> EngineConfig:
    """`cfg` with `--colocate auto` replaced by what it decides on `device_kind`."""
    if cfg.placement.colocate != "auto":
        return cfg
    placement = cfg.placement.model_copy(update={"colocate": colocate_by_default(cfg, device_kind)})
    return cfg.model_copy(update={"placement": placement})


def bundle_resources(accel: Accelerator, devices: int) -> dict[str, float]:
    """A placement-group bundle holding `devices` devices."""
    if accel.ray_resource is None:
        return {"CPU": devices}
    return {accel.ray_resource: devices, "CPU": devices}


def actor_resources(accel: Accelerator, devices: int = 1) -> dict[str, Any]:
    """What an actor using `devices` devices asks Ray for (fits in `bundle_resources(accel, devices)`)."""
    if accel.ray_resource is None:
        return {"num_cpus": devices}
    if accel.ray_resource == "GPU":
        return {"num_cpus": 1, "num_gpus": devices}
    return {"num_cpus": 1, "resources": {accel.ray_resource: devices}}


def describe(bundle: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in bundle.items())


def reserve(bundles: list[dict[str, float]], strategy: str, asked: str) -> PlacementGroup:
    """A ready placement group of `bundles`; raises ConfigError starting with `asked` (the flags) if Ray cannot
    place it within PLACEMENT_TIMEOUT_S."""
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        free = ray.available_resources()
        raise ConfigError(
            f"{asked}: not placed within {PLACEMENT_TIMEOUT_S}s (the cluster has "
            f"{describe({k: free.get(k, 0) for k in bundles[0]})} free; devices held by other work?)"
        )
    return group


def bundle_node_ids(group: PlacementGroup) -> list[str]:
    """The Ray node id of each bundle of a placed group."""
    bundles = placement_group_table(group)["bundles_to_node_id"]
    return [bundles[i] for i in sorted(bundles)]


def nodes_of(group: PlacementGroup) -> list[str]:
    """The Ray node of each bundle of a placed group, as the first 8 hex digits of its node id."""
    return [node[:8] for node in bundle_node_ids(group)]


def wait_until_placed(group: PlacementGroup, bundle: int, timeout: float) -> bool:
    """Whether `bundle` of a placed group sits on a live node within `timeout` seconds. After a node dies Ray
    places its bundles again where room is left, and an actor started in one still missing would wait forever."""
    deadline = time.monotonic() + timeout
    while True:
        table = placement_group_table(group)
        alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        if table["state"] == "CREATED" and table["bundles_to_node_id"].get(bundle) in alive:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(1.0)


def device_nodes(accel: Accelerator) -> list[dict[str, Any]]:
    """The live Ray nodes with devices of `accel`'s kind: where a trainer rank or an engine could be placed."""
    device = accel.ray_resource or "CPU"
    return [node for node in ray.nodes() if node["Alive"] and node["Resources"].get(device, 0) > 0]


def check_nodes_see(nodes: list[dict[str, Any]], paths: dict[str, str]) -> None:
    """Every node must see each of `paths` (by flag) at the same path, or a rank placed there would fail to load
    it, or write checkpoints the driver never sees. Raises ConfigError naming each node and flag."""
    missing = ray.remote(num_cpus=0)(_missing_paths)
    answers = ray.get([
        missing.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(paths)
        for node in nodes
    ])
    unseen = [f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]}) lacks {', '.join(flags)}"
              for node, flags in zip(nodes, answers) if flags]
    if unseen:
        raise ConfigError(
            f"the run's files are not on every node of the Ray cluster: {'; '.join(unseen)}. Put them on a file "
            f"system every node mounts at the same path (NFS, SFS Turbo, a shared volume)"
        )


def _missing_paths(paths: dict[str, str]) -> list[str]:
    return [f"{flag} {path}" for flag, path in paths.items() if not os.path.exists(path)]
