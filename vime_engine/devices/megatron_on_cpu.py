"""Megatron-Core on a CPU-only machine: the `torch.cuda` calls it makes unconditionally, mapped onto the CPU.

The same idea as Ascend's `transfer_to_npu`, which remaps `torch.cuda` onto the NPU. megatron-core (0.16 on
Python 3.11, 0.19 on 3.12) calls `torch.cuda.*` and `Tensor.cuda()` in its RNG tracker, optimizer,
dist-checkpointing and DDP buffers whatever the device, builds a few tensors with `device="cuda"`, and its
gradient clipping asserts that every gradient is a `torch.cuda.FloatTensor`. On a machine without CUDA those calls
land on the CPU here and gradients are clipped by the same rule, so `vimeflow convert`, `vimeflow train --train-backend megatron`
and the pipeline's convert stage run on CPU from the installed package.

Mixture-of-experts layers and sequence parallelism need four more: TE's fused MoE kernels defined as absent (0.16),
the token dispatcher's split sizes on the host as the device path leaves them, uneven all-gathers (expert tensor
parallelism) over gloo, and torch's norms marked for sequence parallelism as Apex's and TE's are.

`prepare_accelerator(CPU)` calls `enable_megatron_on_cpu()` in every process that trains or converts with
Megatron (the driver's convert, each trainer rank); it does nothing where CUDA is available, so a GPU keeps the
real calls.
"""

from __future__ import annotations

import contextlib
import copy
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
    _moe_kernels_absent_without_transformer_engine()
    _moe_split_sizes_on_host()
    _uneven_first_dim_collectives_on_gloo()
    _sequence_parallel_torch_norms()


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
    """A stream and its events at once: work is already ordered on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def record_event(self, event=None) -> _CpuStream:
        return self  # the MoE token dispatcher synchronizes on the event a stream records

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None  # wait_stream, wait_event, record, synchronize, query


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


# Transformer Engine's fused MoE kernels, which megatron-core's moe_utils tests against None before use.
_TE_MOE_KERNELS = (
    "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs",
    "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
    "fused_unpermute", "te_general_gemm",
)


def _moe_kernels_absent_without_transformer_engine() -> None:
    """megatron-core 0.16 leaves those names undefined when TE is not installed (there never is on CPU), so its
    router's first forward dies with NameError; 0.19 sets them to None, which selects the plain torch code."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False):
        for name in _TE_MOE_KERNELS:
            if not hasattr(moe_utils, name):
                setattr(moe_utils, name, None)


def _moe_split_sizes_on_host() -> None:
    """The MoE alltoall dispatcher copies its split sizes from the device to the host as numpy arrays
    (`maybe_move_tensor_to_cpu(..., as_numpy=True)`) for `all_to_all_single`, which takes sequences of ints; for a
    tensor already on the CPU that helper returns the tensor itself, which gloo's all_to_all_single refuses. Here
    the CPU tensors get the host form the device ones would."""
    from megatron.core.transformer.moe import moe_utils

    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def on_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(module, "maybe_move_tensor_to_cpu", None) is original:
            module.maybe_move_tensor_to_cpu = on_host


def _uneven_first_dim_collectives_on_gloo() -> None:
    """Expert tensor parallelism gathers token blocks of different sizes per rank (`output_split_sizes`), which
    megatron-core does with `all_gather` over a list of unequal tensors: NCCL can, gloo needs equal sizes. On CPU
    that gather runs as one all_gather of blocks padded to the largest (the reduce-scatter back is gloo's own)."""
    from megatron.core.tensor_parallel import mappings

    gather = mappings._gather_along_first_dim

    @functools.wraps(gather)
    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return torch.cat(_gather_padded(input_, group, list(output_split_sizes)))

    mappings._gather_along_first_dim = gather_uneven


def _gather_padded(tensor: torch.Tensor, group, sizes: list[int]) -> list[torch.Tensor]:
    """Every rank's `tensor` (rank r's has sizes[r] rows), gathered with one equal-size all_gather of blocks
    padded to the largest; collective over `group`."""
    longest = max(sizes)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    blocks = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(blocks, padded, group=group)
    return [block[:size] for block, size in zip(blocks, sizes)]


def _sequence_parallel_torch_norms() -> None:
    """Sequence parallelism with megatron-core's local layers: their norms are torch's (`WrappedTorchNorm`), which
    refuse `sequence_parallel` because only Apex's and Transformer Engine's (CUDA) norms mark their weights for it.
    Under sequence parallelism each tensor-parallel rank normalises its slice of the sequence, so a norm weight's
    gradient is partial and must be summed over the ranks, which Megatron's `finalize_model_grads` does for
    weights marked `sequence_parallel`. On CPU torch's norms are built so and marked the same way (Megatron needs
    sequence parallelism for a MoE model under tensor parallelism)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        without = copy.copy(config)
        without.sequence_parallel = False
        norm = original(cls, without, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = __new__
