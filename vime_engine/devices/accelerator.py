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
    {
        # vLLM's in-process engine inside the actor; the multiprocess engine would fork a second engine process.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # oneDNN caches a compiled primitive per matmul shape, 1,024 of them by default; each rollout's batches
        # bring new shapes, so the rollout actor crept up by ~0.5 MB a rollout (bench/soak.py). vLLM's CPU linear
        # layers keep their own 32 recent shapes each; with 64 here the soak ran no slower and stayed flat.
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
    },
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


# At most this many torch threads an actor (set on every node of the cluster): for a machine that other work
# shares. Each OpenMP region of a kernel waits for all of its threads, so a thread that loses its core to another
# process stalls every layer (bench/cpu_threads.py).
CPU_THREADS_ENV = "VIMEFLOW_CPU_THREADS"


def cpu_threads(cores: int, group_on_node: int, overlapped: bool, limit: int | None = None) -> int:
    """Torch threads of one CPU actor, a trainer rank or an engine, of a group with `group_on_node` actors on a
    node of `cores` cores, at most `limit` (None: no limit).

    Ray starts a one-CPU actor with OMP_NUM_THREADS=1, which left a core idle whenever one side worked. In the
    synchronous loop the engines wait while the trainer trains and the other way round, so each group's actors
    split all the node's cores; under --async-rollout the two sides work at once and the other keeps a share.
    """
    share = max(1, cores // (group_on_node + (1 if overlapped else 0)))
    return share if limit is None else min(share, limit)


def cpu_thread_limit() -> int | None:
    """CPU_THREADS_ENV as a positive number of threads, None when unset; ValueError naming it otherwise."""
    import os

    value = os.environ.get(CPU_THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{CPU_THREADS_ENV}={value!r}: give a whole number of threads, 1 or more, or unset it")
    return int(value)


def cpu_share(group_on_node: int, overlapped: bool) -> int:
    """This process's `cpu_threads` share of the cores it may use, within CPU_THREADS_ENV."""
    import os

    return cpu_threads(len(os.sched_getaffinity(0)), group_on_node, overlapped, cpu_thread_limit())


def use_cpu_share(group_on_node: int, overlapped: bool) -> None:
    """Run this process's torch on its `cpu_share` (before vLLM starts: its CPU backend refuses a thread count set
    later)."""
    import torch

    torch.set_num_threads(cpu_share(group_on_node, overlapped))


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


class AcceleratorSetupError(RuntimeError):
    """The process cannot use the chosen accelerator; the message says what to install, source or reorder."""


# CANN's set_env.sh exports these; without them torch_npu cannot find the Ascend runtime.
ASCEND_TOOLKIT_ENV = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
ASCEND_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"


def prepare_accelerator(acc: Accelerator, local_rank: int | None = None) -> None:
    """Make this process ready to train on `acc`; the Megatron backend calls it before importing Megatron.

    cpu: map the `torch.cuda` calls megatron-core makes unconditionally onto the CPU (`megatron_on_cpu`; nothing
    when CUDA is available). cuda: select the local GPU. npu: check the Ascend environment (CANN's set_env.sh was
    sourced), apply `actor_env`, import torch_npu (it registers `torch.npu` and the hccl backend), select the
    local NPU, and import MindSpeed's Megatron adaptor, which must patch Megatron before any `megatron` import.
    Idempotent.
    """
    import os
    import sys

    rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    if acc.kind == "cuda":
        import torch

        torch.cuda.set_device(rank)
        return
    if acc.kind == "cpu":
        from vime_engine.devices.megatron_on_cpu import enable_megatron_on_cpu

        enable_megatron_on_cpu()
        return
    if "mindspeed.megatron_adaptor" in sys.modules:
        return
    early = sorted(name for name in sys.modules if name == "megatron" or name.startswith("megatron."))
    if early:
        raise AcceleratorSetupError(
            f"Megatron was imported before MindSpeed's adaptor ({early[0]} …): call prepare_accelerator() "
            "first in the training process, before any megatron import"
        )
    if not any(os.environ.get(name) for name in ASCEND_TOOLKIT_ENV):
        raise AcceleratorSetupError(
            f"the Ascend toolkit environment is not set ({' / '.join(ASCEND_TOOLKIT_ENV)}): "
            f"source {ASCEND_SET_ENV} before starting the trainer"
        )
    for key, value in acc.actor_env.items():
        os.environ.setdefault(key, value)
    try:
        import torch_npu  # noqa: F401  (registers torch.npu and the hccl backend)
    except ImportError as exc:
        raise AcceleratorSetupError(f"--device npu needs torch_npu (the NPU image provides it): {exc}") from exc
    import torch

    torch.npu.set_device(rank)
    try:
        import mindspeed.megatron_adaptor  # noqa: F401
    except ImportError as exc:
        raise AcceleratorSetupError(
            f"--train-backend megatron on NPU needs MindSpeed (installed from source in the NPU image): {exc}"
        ) from exc
