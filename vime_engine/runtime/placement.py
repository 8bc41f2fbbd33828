"""Reserving devices on Ray for the trainer group and the rollout group: bundles, actor resources, placement.

A "device" is one GPU / NPU (with one CPU beside it), or on CPU one of Ray's logical CPUs. Both groups reserve
their devices in a placement group first, so a cluster that cannot hold them fails at once naming the flags,
instead of leaving actors pending forever.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from vime_engine.config import ConfigError
from vime_engine.runtime.devices import Accelerator

PLACEMENT_TIMEOUT_S = 120


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
