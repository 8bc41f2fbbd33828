"""Test-only: run megatron-core (0.16 in the main lane, 0.19 in the 3.12 lane) on a CPU-only machine.

Two pieces, the same idea as Ascend's `transfer_to_npu` (which remaps `torch.cuda` onto the NPU):

* `install_cpu_cuda_shim()`: megatron-core calls `torch.cuda.*` and `Tensor.cuda()` unconditionally in a few
  places (RNG tracker, optimizer, dist-checkpointing, DDP buffers); these are mapped to the CPU. Main-lane tests
  (vLLM + Megatron in one run) and the Megatron lane's both use it; `prepare_ray_worker` installs it in Ray's
  rank processes.
* `import_megatron_bridge()`: only for the test that compares our HF mapping with Megatron-Bridge's (the engine
  does not use the bridge). The bridge imports `transformer_engine.pytorch` at module level in its LoRA layers;
  a stub is placed in `sys.modules` only while it is imported and removed right after, so every `try: import
  transformer_engine` in megatron-core still fails and Megatron keeps its local (non-TE) layers.

Production code never imports this module: on CUDA and NPU (with MindSpeed) the real calls apply.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import types
from pathlib import Path

import torch

_installed = False


class _Placeholder(type):
    """A class that no object is an instance of; attribute access yields further placeholders."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


def _stub_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__getattr__ = lambda attr: _Placeholder(attr, (), {})  # type: ignore[method-assign]
    module.__path__ = []  # a package, so `transformer_engine.pytorch` resolves
    module.__version__ = "0.0.0"  # megatron-core caches this version: 0.0.0 reads as "no TE features"
    return module


@contextlib.contextmanager
def _transformer_engine_stub():
    te = _stub_module("transformer_engine")
    te_pytorch = _stub_module("transformer_engine.pytorch")
    te.pytorch = te_pytorch
    sys.modules["transformer_engine"] = te
    sys.modules["transformer_engine.pytorch"] = te_pytorch
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
            del sys.modules[name]


def import_megatron_bridge() -> types.ModuleType:
    """Import megatron-core first (no TE: local layers), then Megatron-Bridge with the stub in place."""
    import megatron.core  # noqa: F401
    import megatron.core.extensions  # noqa: F401
    import megatron.core.models.gpt.experimental_attention_variant_module_specs  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
    import megatron.core.transformer  # noqa: F401

    with _transformer_engine_stub():
        bridge = importlib.import_module("megatron.bridge")
        importlib.import_module("megatron.bridge.models.conversion.auto_bridge")
        importlib.import_module("megatron.bridge.peft.lora_layers")
    return bridge


def install_cpu_cuda_shim() -> None:
    """Map the `torch.cuda` calls megatron-core makes unconditionally onto the CPU (idempotent)."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    _installed = True
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    # The "device" generator is the CPU generator: Megatron's RNG tracker forks and restores it.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls this after seeding the CPU
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    cuda.device_count = lambda: 0
    # One CPU "stream": work is already ordered, so waits and events are no-ops.
    cuda.Stream = _CpuStream
    cuda.Event = _CpuStream
    cuda.current_stream = lambda device=None: _CpuStream()
    cuda.default_stream = lambda device=None: _CpuStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    _redirect_megatron_factories()


class _CpuStream:
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None  # wait_stream, wait_event, record_event, record, synchronize


# Tensor factories megatron-core calls with device="cuda" (causal masks, optimizer flags, checkpoint sync).
_FACTORIES = ["tensor", "empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint"]
# Loaded before redirecting, so their module-level `torch` can be swapped (lazy imports would miss it).
_MEGATRON_MODULES = [
    "megatron.core.optimizer", "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler", "megatron.core.distributed", "megatron.core.pipeline_parallel.schedules",
    "megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel", "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.data", "megatron.core.models.common.embeddings.rotary_pos_embedding",
]


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # a bare index means a CUDA device to torch


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


class _TorchOnCpu(types.ModuleType):
    """`torch` as Megatron's modules see it: the real module, with device="cuda" factories landing on the CPU.

    Scoped to Megatron's own module globals: wrapping `torch.tensor` process-wide breaks transformers' meta-device
    model loading (rotary buffers come out zero).
    """

    def __init__(self):
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _redirect_megatron_factories() -> None:
    for name in _MEGATRON_MODULES:
        importlib.import_module(name)
    proxy = _TorchOnCpu()
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(module, "torch", None) is torch:
            module.torch = proxy


def prepare_ray_worker() -> None:
    """Ray's `worker_process_setup_hook` for the trainer group's rank processes in the CPU tests."""
    install_cpu_cuda_shim()


@contextlib.contextmanager
def shimmed_ray_cluster(num_cpus: int = 4):
    """A private Ray cluster whose every worker process installs the CPU shim, joined by the engine's
    `ray_cluster()` (which then leaves it running) for the tests that drive Megatron ranks through Ray."""
    import ray

    from vime_engine.runtime.cluster import ray_cluster

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env={
        "worker_process_setup_hook": "tests.megatron.cpu_compat.prepare_ray_worker",
        "env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"},
    })
    try:
        with ray_cluster():
            yield
    finally:
        ray.shutdown()


def with_ray_worker_shim(runtime_env: dict | None) -> dict:
    """Ray's `RAY_RUNTIME_ENV_HOOK`, for the CPU tests whose Ray is started by another process (the pipeline's
    engine child): every job it starts gets `prepare_ray_worker` in its worker processes."""
    runtime_env = dict(runtime_env or {})
    runtime_env["worker_process_setup_hook"] = "tests.megatron.cpu_compat.prepare_ray_worker"
    # The repository first; what the job's process already had (e.g. the fault-injection hooks) after it.
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))
    runtime_env["env_vars"] = {"PYTHONPATH": path, **runtime_env.get("env_vars", {})}
    return runtime_env
