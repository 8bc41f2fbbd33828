"""Megatron on CPU as users run it: `prepare_accelerator(CPU)` (what the backend and `vimeflow convert` call)
makes megatron-core's own gradient clipping work on CPU tensors, by the rule torch's clipping uses."""

from __future__ import annotations

import torch

from vime_engine.devices.accelerator import CPU, prepare_accelerator


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(4, 8), (8,), (3, 3)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


def test_megatron_clips_cpu_gradients_as_torch_does():
    prepare_accelerator(CPU)
    from megatron.core.optimizer import optimizer as megatron_optimizer

    ours, theirs = _params(0), _params(0)
    total = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours])).item()
    assert total > 1.0  # so a max norm of 1 clips
    megatron_optimizer.clip_grad_by_total_norm_fp32(ours, max_norm=1.0, total_norm=total)
    torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours])).item()
    assert abs(clipped - 1.0) < 1e-5

    within = _params(1)
    before = [p.grad.clone() for p in within]
    megatron_optimizer.clip_grad_by_total_norm_fp32(within, max_norm=1e9, total_norm=total)
    assert all(torch.equal(p.grad, b) for p, b in zip(within, before))  # under the max norm: untouched
