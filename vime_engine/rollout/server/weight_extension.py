"""The weight reload a server's workers run when the sync asks for it (vLLM's `--worker-extension-cls`).

vLLM mixes this class into each of its workers; the sync calls `vime_reload` on all of them at once through the
server's `/collective_rpc` endpoint (which takes JSON, so the tensors travel as a safetensors file the actor wrote
beside the server, in shared memory on Linux). The load is the in-process engine's (vime_engine/weight_sync/
vllm_reload.py): vLLM's layer-by-layer reload, then the CPU MoE repack.
"""

from __future__ import annotations


class WeightReloadExtension:
    def vime_reload(self, path: str) -> int:
        """Load the HF-named tensors of the safetensors file at `path` into this worker's model; returns how many."""
        from safetensors import safe_open
        from vllm.platforms import current_platform

        from vime_engine.weight_sync.vllm_reload import repack_cpu_moe_experts

        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            self.reload_weights(weights_iterator=((name, f.get_tensor(name)) for name in names))
        if current_platform.is_cpu():
            repack_cpu_moe_experts(self)
        return len(names)
