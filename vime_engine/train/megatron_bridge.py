"""`--megatron-to-hf-mode bridge`: Megatron-Bridge's AutoBridge moves the weights between HF tensors and the Megatron
model this engine builds, where the raw mode uses our own mapping (megatron_hf.py).

It acts wherever HF weights cross into or out of Megatron: the policy's and the reference's initial weights from an HF
directory, the weight sync's HF-named stream (gathered over tensor-, pipeline- and expert-parallel ranks; collective),
`--save-hf`, and `vimeflow convert` in both directions. For the families the engine builds itself (megatron_hf's
`HFArchitecture`, `transformer_config`) the two modes give the same torch_dist layout and the same HF tensors
(tests/megatron/test_hf_mapping.py), so a checkpoint written in one mode loads in the other.

The families our mapping lacks (megatron_hf.BRIDGE_FAMILIES: DeepSeek-V3, GLM-4.5) are built from the bridge's model
provider (`BridgeMapping.build_gpt`): its architecture (multi-latent attention, sigmoid routing with an expert bias,
group-limited routing, shared experts, YaRN rope) with the engine's parallel layout, dtype and MoE run settings on top.
Without Transformer Engine the layers are Megatron's local ones.

Megatron-Bridge needs Python >= 3.12 (megatron-core >= 0.17): the Megatron lane's venv and the images have it, the
main venv does not, and preflight refuses the mode there. Its LoRA layers import Transformer Engine at module level;
where TE is not installed (CPU) a placeholder stands in for it during that import only, so megatron-core's own
`try: import transformer_engine` still fails afterwards and the model keeps Megatron's local layers.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from vime_engine.train.megatron_hf import (
    EMBED,
    LM_HEAD,
    HFArchitecture,
    UnsupportedHFModel,
    layout_fields,
    moe_run_fields,
    safetensors_files,
    transformer_engine_available,
)
from vime_engine.train.megatron_layout import ParallelLayout
from vime_engine.train.megatron_mtp import is_mtp_tensor, say_mtp_skipped


class _Placeholder(type):
    """A class no object is an instance of; its attributes are further placeholders (TE's layer classes, which the
    bridge's LoRA wrappers name in isinstance checks and base classes)."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


def _placeholder_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__getattr__ = lambda attr: _Placeholder(attr, (), {})  # type: ignore[method-assign]
    module.__path__ = []  # a package, so `transformer_engine.pytorch` resolves
    module.__version__ = "0.0.0"  # megatron-core caches TE's version: 0.0.0 reads as "no TE features"
    return module


@contextlib.contextmanager
def _transformer_engine_placeholder():
    te, te_pytorch = _placeholder_module("transformer_engine"), _placeholder_module("transformer_engine.pytorch")
    te.pytorch = te_pytorch
    sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": te_pytorch})
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
            del sys.modules[name]


def auto_bridge_class() -> type:
    """Megatron-Bridge's AutoBridge, imported after megatron-core's layer modules (which must see no TE when there is
    none) and, without TE, with the placeholder in place for the bridge's own import."""
    if transformer_engine_available():
        return importlib.import_module("megatron.bridge").AutoBridge
    for name in ("megatron.core.extensions", "megatron.core.models.gpt.gpt_layer_specs",
                 "megatron.core.models.gpt.experimental_attention_variant_module_specs", "megatron.core.transformer",
                 "megatron.core.tensor_parallel"):
        importlib.import_module(name)
    with _transformer_engine_placeholder():
        bridge = importlib.import_module("megatron.bridge")
        importlib.import_module("megatron.bridge.models.conversion.auto_bridge")
        importlib.import_module("megatron.bridge.peft.lora_layers")
    return bridge.AutoBridge


def _local_mla_attention() -> type:
    """Megatron's local DotProductAttention for multi-latent attention: megatron-core (0.19) builds MLA's core attention
    with keys and values of different head sizes (k_channels = nope + rope, v_channels), which only TE's attention
    accepts; the local one's arithmetic already follows the tensors' own sizes, only its output width must be the
    value heads'."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class LocalMLAAttention(DotProductAttention):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, k_channels=None, v_channels=None,
                     **kwargs):
            super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads,
                                                        self.pg_collection.tp.size())

    return LocalMLAAttention


def _local_layer_spec(config):
    """The decoder block of Megatron's local layers (no Transformer Engine), MLA's core attention made to fit."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    if config.multi_latent_attention:
        attention = _local_mla_attention()
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = attention
    return spec


class BridgeMapping:
    """The HF <-> Megatron weights of one model through AutoBridge (the `HFMapping` of megatron_model.py).

    Megatron-Bridge skips, with a warning, a parameter it has no mapping or no HF tensor for, which would leave it at
    its random init (or missing from the export): here every parameter of this rank must be covered, or the model is
    refused naming the parameters. With the whole model on one rank, every tensor of the HF files must be read too,
    but for the multi-token-prediction layers' (not built: megatron_mtp), which the export leaves to its caller.
    """

    def __init__(self, arch: HFArchitecture, hf_config_dir: str | Path):
        from transformers import AutoConfig

        self.arch = arch
        config = AutoConfig.from_pretrained(str(hf_config_dir))
        try:
            self.bridge = auto_bridge_class().from_hf_config(config)
        except ValueError as exc:
            raise UnsupportedHFModel(f"{hf_config_dir}: Megatron-Bridge has no bridge for this model "
                                     f"({' '.join(str(exc).split())[:300]})") from None
        self.config = config

    def build_gpt(self, layout: ParallelLayout, dtype: torch.dtype, use_cpu_initialization: bool,
                  routing_replay: bool) -> torch.nn.Module:
        """This rank's Megatron GPT model (its pipeline stage) of a BRIDGE_FAMILIES model, built by the bridge's
        provider at Megatron's random init (the weights come in through `load`)."""
        from megatron.core import parallel_state

        provider = self.bridge.to_megatron_provider(load_weights=False)
        te = transformer_engine_available()
        settings = {**layout_fields(layout, dtype, use_cpu_initialization), **moe_run_fields(layout.moe, te)}
        if settings["moe_router_dtype"] is None:
            del settings["moe_router_dtype"]  # the provider's (fp32 for DeepSeek-V3 and GLM-4.5, as HF's gate)
        for name, value in settings.items():
            setattr(provider, name, value)
        provider.perform_initialization = True  # marks the tensor-parallel attributes the mapping and optimizer read
        provider.make_vocab_size_divisible_by = 1  # padded to the tensor-parallel size only, as the engine's own
        provider.moe_enable_routing_replay = routing_replay
        # The checkpoint's multi-token-prediction layers stay out of the policy (megatron_mtp): the provider would
        # build them from num_nextn_predict_layers.
        provider.mtp_num_layers = None
        if layout.moe.expert_bias_update_rate is not None:
            provider.moe_router_bias_update_rate = layout.moe.expert_bias_update_rate
        if not te:
            provider.transformer_layer_spec = _local_layer_spec
            # Fusions that need TE's or Apex's kernels, and the shared expert's overlap on a second CUDA stream.
            provider.cross_entropy_loss_fusion = False
            provider.moe_shared_expert_overlap = False
        provider.finalize()
        return provider.provide(pre_process=parallel_state.is_pipeline_first_stage(),
                                post_process=parallel_state.is_pipeline_last_stage())

    def load(self, chunks: list[torch.nn.Module], hf_dir: str | Path) -> None:
        """Copy the HF directory's tensors into this rank's parameter shards of the unwrapped GPT modules (the bridge
        splits them over TP/EP)."""
        tasks = self.bridge.get_conversion_tasks(chunks, hf_path=str(hf_dir))
        self._check_covered(tasks, chunks, f"{hf_dir}")
        self._check_all_read(tasks, Path(hf_dir))
        self.bridge.load_hf_weights(chunks, hf_path=str(hf_dir))
        if self.arch.mtp_layers:
            say_mtp_skipped(str(hf_dir), self.arch.mtp_layers)

    def export(self, chunks: list[torch.nn.Module], with_lm_head: bool) -> Iterator[tuple[str, Tensor]]:
        """Every HF tensor of the (unwrapped) model on every rank (collective: every rank must iterate to the end);
        with tied embeddings `lm_head.weight` too when `with_lm_head` (vLLM needs it), as the raw mode gives it."""
        # The config-only bridge: the names come from the mapping, not from an HF directory's files.
        tasks = self.bridge._model_bridge.build_conversion_tasks(self.config, chunks)
        self._check_covered(tasks, chunks, "the export")
        tied = self.arch.tied_embeddings
        for name, tensor in self.bridge.export_hf_weights(chunks, cpu=False, show_progress=False,
                                                          conversion_tasks=tasks):
            if name == LM_HEAD and tied:
                continue  # a config-only bridge names the shared matrix twice; given below only when asked
            yield name, tensor
            if name == EMBED and tied and with_lm_head:
                yield LM_HEAD, tensor

    def _check_covered(self, tasks, chunks: list[torch.nn.Module], where: str) -> None:
        covered = {(t.vp_stage, t.param_name) for t in tasks if t is not None and t.megatron_module is not None}
        # Tied embeddings under pipeline parallelism: the last stage's copy of the shared matrix is not mapped; the
        # bridge fills it from the first stage's on load, and the first stage's is the one exported.
        shared = {"output_layer.weight"} if self.arch.tied_embeddings else set()
        missing = [name for i, chunk in enumerate(chunks) for name, _ in chunk.named_parameters()
                   if (i, name) not in covered and name not in shared]
        if missing:
            hint = "use --megatron-to-hf-mode raw"
            if self.arch.built_by_bridge:  # no mapping of ours to fall back on
                hint = ("the bridge builds this family and maps no other layers"
                        + ("" if transformer_engine_available() else "; these are Megatron's local layers, as without "
                           "Transformer Engine (GLM-4.5's bridge maps routed experts only in TE's grouped layout)"))
            raise UnsupportedHFModel(f"{where}: Megatron-Bridge maps no HF tensor to the Megatron parameters "
                                     f"{missing[:5]} ({hint})")

    def _check_all_read(self, tasks, hf_dir: Path) -> None:
        from megatron.core import parallel_state as ps

        whole_model = (ps.get_pipeline_model_parallel_world_size() == 1
                       and ps.get_expert_model_parallel_world_size() == 1)
        if not whole_model:
            return  # the other ranks read the rest
        read = set()
        for task in tasks:
            if task is not None:
                hf = task.mapping.hf_param
                read.update([hf] if isinstance(hf, str) else hf.values())
        arch = self.arch
        unused = {name for name in set(safetensors_files(hf_dir)) - read
                  if not is_mtp_tensor(name, arch)}
        unused -= {LM_HEAD} if arch.tied_embeddings else set()
        if unused:
            raise UnsupportedHFModel(f"{hf_dir}: tensors Megatron-Bridge's mapping does not use: {sorted(unused)[:5]}")
