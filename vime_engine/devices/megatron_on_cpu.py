"""Megatron-Core on a CPU-only machine: the `torch.cuda` calls it makes unconditionally, mapped onto the CPU.

The same idea as Ascend's `transfer_to_npu`, which remaps `torch.cuda` onto the NPU. megatron-core (0.16 on
Python 3.11, 0.19 on 3.12) calls `torch.cuda.*` and `Tensor.cuda()` in its RNG tracker, optimizer,
dist-checkpointing and DDP buffers whatever the device, builds a few tensors with `device="cuda"`, and its
gradient clipping asserts that every gradient is a `torch.cuda.FloatTensor`. On a machine without CUDA those calls
land on the CPU here and gradients are clipped by the same rule, so `vimeflow convert`, `vimeflow train --train-backend megatron`
and the pipeline's convert stage run on CPU from the installed package.

`prepare_accelerator(CPU)` calls `enable_megatron_on_cpu()` in every process that trains or converts with
Megatron (the driver's convert, each trainer rank); it does nothing where CUDA is available, so a GPU keeps the
real calls.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types

import torch

_enabled = False

# Tensor factories megatron-core calls with device="cuda" (causal masks, optimizer flags, checkpoint sync).
_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "rand", "randn", "randint")
# Imported before their `torch` global is swapped: a module imported later would keep the real one.
_MEGATRON_MODULES = (
    "megatron.core.optimizer", "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler", "megatron.core.distributed", "megatron.core.pipeline_parallel.schedules",
    "megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel", "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.data", "megatron.core.models.common.embeddings.rotary_pos_embedding",
)


def enable_megatron_on_cpu() -> None:
    """Map the `torch.cuda` calls megatron-core makes onto the CPU (idempotent; nothing when CUDA is available)."""
    global _enabled
    if _enabled or torch.cuda.is_available():
        return
    _enabled = True
    _map_cuda_runtime_onto_cpu()
    _map_cuda_rng_onto_cpu()
    _redirect_megatron_factories()
    _clip_gradients_on_cpu()


def _map_cuda_runtime_onto_cpu() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
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


def _map_cuda_rng_onto_cpu() -> None:
    """Megatron's RNG tracker forks and restores the "device" generator: on CPU that is the CPU generator, so the
    dropout streams stay reproducible and a resumed run draws what the killed one would have."""
    cuda = torch.cuda
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls this after seeding the CPU
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


class _CpuStream:
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None  # wait_stream, wait_event, record_event, record, synchronize


def is_cuda_device(device: object) -> bool:
    """Whether torch would read `device` as a CUDA device (a bare index is one)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


class _TorchOnCpu(types.ModuleType):
    """`torch` as Megatron's modules see it: the real module, with device="cuda" factories landing on the CPU.

    Scoped to Megatron's own module globals: wrapping `torch.tensor` process-wide breaks transformers' meta-device
    model loading (rotary buffers come out zero), and vLLM may share the process.
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


def clip_by_total_norm(grads: list[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale `grads` in place by max_norm / (total_norm + 1e-6) when that is below 1, Megatron's rule (the 1e-6
    keeps a zero norm finite); a norm at or under `max_norm` leaves them untouched."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        torch._foreach_mul_(grads, coeff)


def _clip_grad_by_total_norm_on_cpu(parameters, max_norm, total_norm, use_decoupled_grad: bool = False) -> None:
    """megatron-core's `clip_grad_by_total_norm_fp32` with its fp32 check made device-neutral."""
    from megatron.core.utils import to_local_if_dtensor

    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [to_local_if_dtensor(g).detach() for g in (getattr(p, attr, None) for p in parameters) if g is not None]
    allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
    wrong = sorted({str(g.dtype) for g in grads if g.dtype not in allowed})
    if wrong:
        raise TypeError(f"gradient clipping expects {' or '.join(map(str, allowed))} gradients, found {wrong}")
    clip_by_total_norm(grads, max_norm, total_norm)


def _clip_gradients_on_cpu() -> None:
    from megatron.core.optimizer import clip_grads

    original = clip_grads.clip_grad_by_total_norm_fp32
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(module, "clip_grad_by_total_norm_fp32", None) is original:
            module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_on_cpu
