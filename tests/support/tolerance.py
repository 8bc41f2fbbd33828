"""How far two different fp32 implementations of the same forward may disagree (Megatron vs HF transformers, vLLM
vs the trainer). Where the same code runs on both sides (resume, DP=2 vs DP=1, M engines) the tests demand
equality instead: this bound is only for two implementations, whose kernels round differently and differently
again on another CPU (AMX / AVX-512 paths vary by host)."""

from __future__ import annotations

import math

import torch

FP32_EPS = torch.finfo(torch.float32).eps  # 2**-23


def fp32_tolerance(magnitude: torch.Tensor | float, reduction_length: int, depth: int) -> torch.Tensor | float:
    """Bound on |a - b| for two fp32 implementations of a quantity of this `magnitude`.

    Each dot product of length n rounds with a relative error that grows like sqrt(n)·eps (rounding errors
    add as a random walk; the worst case n·eps is not approached with round-to-nearest). A log-prob
    z_t - logsumexp(z) carries that relative error at about its own magnitude, and each of the `depth`
    sub-layers on the way (attention and MLP of every layer, then the head) adds one such term; two
    implementations differ by at most the sum of both sides' errors:

        2 · depth · sqrt(n) · eps · max(|magnitude|, 1)

    (the floor of 1: a log-prob near 0 still comes from logits of order 1). For the tiny Qwen3 (hidden 128, 2
    layers: depth 5) that is 1.3e-5 relative; a wrong mapping or a missing norm is off by 1e-2 or more.
    """
    scale = 2 * depth * math.sqrt(reduction_length) * FP32_EPS
    if isinstance(magnitude, torch.Tensor):
        return scale * magnitude.abs().clamp(min=1.0)
    return scale * max(abs(magnitude), 1.0)


def model_depth(num_layers: int) -> int:
    """Sub-layers a token's log-prob passes through: attention and MLP per layer, then the output head."""
    return 2 * num_layers + 1


def assert_fp32_close(ours: torch.Tensor, reference: torch.Tensor, hidden_size: int, num_layers: int) -> None:
    """Every element of `ours` within `fp32_tolerance` of `reference`; the message names the worst one."""
    bound = fp32_tolerance(reference, hidden_size, model_depth(num_layers))
    excess = (ours - reference).abs() / bound
    worst = int(excess.argmax())
    assert excess.max().item() <= 1.0, (
        f"element {worst}: {ours.flatten()[worst].item()} vs {reference.flatten()[worst].item()}, "
        f"beyond the fp32 bound {bound.flatten()[worst].item():.2e}")
