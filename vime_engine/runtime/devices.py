"""The accelerator a run uses, chosen once: device string, distributed backend, Ray resource, environment.

No other module branches on the device; they read these fields.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Accelerator:
    kind: str  # cpu | cuda | npu
    torch_device: str
    dist_backend: str  # gloo | nccl | hccl
    ray_resource: str | None  # the Ray resource an actor asks for; None on CPU
    visible_devices_env: str | None
    actor_env: dict[str, str] = field(default_factory=dict)


CPU = Accelerator(
    "cpu", "cpu", "gloo", None, None,
    # vLLM's in-process engine inside the actor; the multiprocess engine would fork a second engine process.
    {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
)
CUDA = Accelerator("cuda", "cuda", "nccl", "GPU", "CUDA_VISIBLE_DEVICES", {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
NPU = Accelerator(
    "npu", "npu", "hccl", "NPU", "ASCEND_RT_VISIBLE_DEVICES",
    {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # Ray must not rewrite the visible-device list that the NPU runtime reads.
        "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1",
    },
)


def resolve_accelerator(choice: str = "auto") -> Accelerator:
    """`auto` picks CUDA when torch sees a GPU, NPU when torch_npu is installed, else CPU."""
    if choice == "cpu":
        return CPU
    if choice == "cuda":
        return CUDA
    if choice == "npu":
        return NPU
    if choice != "auto":
        raise ValueError(f"--device {choice!r}: expected auto, cpu, cuda or npu")
    import torch

    if torch.cuda.is_available():
        return CUDA
    if importlib.util.find_spec("torch_npu") is not None:
        return NPU
    return CPU
