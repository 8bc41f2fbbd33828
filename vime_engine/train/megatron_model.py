"""Building a Megatron-Core GPT model from an HF directory (the mapping in megatron_hf), and its torch_dist files.

Shared by the Megatron training backend and the checkpoint converter. Import this module only after
`vime_engine.devices.accelerator.prepare_accelerator` ran: on Ascend, MindSpeed's adaptor must patch Megatron before
the first `megatron` import, and this module imports Megatron at the top.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from torch import Tensor

from vime_engine.devices.accelerator import Accelerator
from vime_engine.train import megatron_hf as mh
from vime_engine.train.megatron_layout import MegatronSetupError, MegatronToHFMode, ParallelLayout
from vime_engine.train.megatron_hf import (  # noqa: F401  (the converted layout, re-exported for convert.py)
    HF_CONFIG_DIR,
    TORCH_DIST_ITERATION_DIR,
    HFArchitecture,
    architecture_of,
    hf_config_dir,
    is_converted_checkpoint,
)


class HFMapping(Protocol):
    """How HF tensors enter and leave this rank's Megatron model (`--megatron-to-hf-mode`): raw, the engine's own
    mapping (megatron_hf.py), or bridge, Megatron-Bridge's AutoBridge (megatron_bridge.py)."""

    def load(self, chunks: list[torch.nn.Module], hf_dir: str | Path) -> None:
        """An HF directory's tensors into this rank's parameter shards of the unwrapped GPT chunks."""

    def export(self, chunks: list[torch.nn.Module], with_lm_head: bool) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) of the whole model on every rank; collective over TP/PP/EP ranks."""


@dataclass(frozen=True)
class RawMapping:
    arch: HFArchitecture

    def load(self, chunks: list[torch.nn.Module], hf_dir: str | Path) -> None:
        mh.load_hf_weights(chunks, self.arch, hf_dir)

    def export(self, chunks: list[torch.nn.Module], with_lm_head: bool) -> Iterator[tuple[str, Tensor]]:
        return mh.export_hf_weights(chunks, self.arch, with_lm_head)


def hf_mapping(mode: MegatronToHFMode, arch: HFArchitecture, source: str | Path) -> HFMapping:
    """The mapping of `--megatron-to-hf-mode` for the model of `source` (an HF directory or a converted checkpoint)."""
    if mode == "raw":
        return RawMapping(arch)
    if mode == "bridge":
        from vime_engine.train.megatron_bridge import BridgeMapping

        return BridgeMapping(arch, hf_config_dir(source))
    raise ValueError(f"--megatron-to-hf-mode {mode!r}: expected raw or bridge")


def init_distributed(accelerator: Accelerator, layout: ParallelLayout, seed: int) -> None:
    """Join (or start, for one process) the process group, then Megatron's model-parallel groups.

    torchrun / Ray set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a single process without them gets a
    world of one. Existing model-parallel groups with a different layout are torn down first.
    """
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:  # a world of one: any free port
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
        torch.distributed.init_process_group(
            accelerator.dist_backend,
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
        )
    world = torch.distributed.get_world_size()
    if world % layout.model_parallel_size:
        raise MegatronSetupError(
            f"world size {world} is not a multiple of tensor × pipeline × context parallel size "
            f"{layout.model_parallel_size}"
        )
    if parallel_state.model_parallel_is_initialized():
        same = (
            parallel_state.get_tensor_model_parallel_world_size() == layout.tensor
            and parallel_state.get_pipeline_model_parallel_world_size() == layout.pipeline
            and parallel_state.get_expert_model_parallel_world_size() == layout.expert
            and parallel_state.get_expert_tensor_parallel_world_size() == (layout.expert_tensor or layout.tensor)
        )
        if same:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        context_parallel_size=layout.context,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_model(
    arch: HFArchitecture,
    layout: ParallelLayout,
    dtype: torch.dtype,
    accelerator: Accelerator,
    hf_dir: str | Path | None = None,
    ddp_config: Any = None,
    routing_replay: bool = False,
    mapping: HFMapping | None = None,
) -> list[torch.nn.Module]:
    """This rank's Megatron GPT model (one chunk: its pipeline stage), with the HF weights of `hf_dir` loaded
    through `mapping` (default: raw) when given (otherwise Megatron's random init, e.g. before loading a torch_dist
    checkpoint). A family Megatron-Bridge builds (`arch.built_by_bridge`) is built by `mapping`, the bridge's.

    Mixed-precision wrapper for bf16 / fp16, Megatron's DDP wrapper when `ddp_config` is given; with
    `routing_replay`, a RouterReplay in every MoE layer's router (vime_engine.train.megatron_routing_replay).
    """
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    if arch.built_by_bridge:
        model: torch.nn.Module = _bridge_mapping(mapping, arch).build_gpt(
            layout, dtype, use_cpu_initialization=accelerator.kind == "cpu", routing_replay=routing_replay)
        config = model.config
    else:
        config = mh.transformer_config(arch, layout, dtype, use_cpu_initialization=accelerator.kind == "cpu")
        config.moe_enable_routing_replay = routing_replay  # read by each router as it is built
        # Megatron-Bridge reads the tying from the model's config (its providers carry the field; GPTModel takes it as
        # an argument): without it the bridge would map the last pipeline stage's output layer to a missing
        # lm_head.weight.
        config.share_embeddings_and_output_weights = arch.tied_embeddings
        model = GPTModel(
            config, mh.layer_spec(arch, config), vocab_size=arch.padded_vocab_size(layout.tensor),
            max_sequence_length=arch.max_positions, pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=arch.tied_embeddings, position_embedding_type="rope",
            rotary_base=arch.rope_theta,
        )
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    model.to(accelerator.torch_device)
    if hf_dir is not None:
        (mapping or RawMapping(arch)).load([model], hf_dir)
    if config.bf16 or config.fp16:
        model = Float16Module(config, model)
    if ddp_config is not None:
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    return [model]


def _bridge_mapping(mapping: HFMapping | None, arch: HFArchitecture):
    from vime_engine.train.megatron_bridge import BridgeMapping

    if not isinstance(mapping, BridgeMapping):
        raise mh.UnsupportedHFModel(f"model_type {arch.model_type!r}: Megatron-Bridge builds this family; use "
                                    "--megatron-to-hf-mode bridge")
    return mapping


def build_model_from(
    source: str | Path,
    arch: HFArchitecture,
    layout: ParallelLayout,
    dtype: torch.dtype,
    accelerator: Accelerator,
    ddp_config: Any = None,
    routing_replay: bool = False,
    mapping: HFMapping | None = None,
) -> list[torch.nn.Module]:
    """`build_model` with the weights of `source`: an HF directory (read through `mapping`), or a torch_dist
    checkpoint written by vime_engine.convert (read in any parallel layout: torch_dist reshards on load)."""
    if not is_converted_checkpoint(source):
        return build_model(arch, layout, dtype, accelerator, hf_dir=source, ddp_config=ddp_config,
                           routing_replay=routing_replay, mapping=mapping)
    model = build_model(arch, layout, dtype, accelerator, ddp_config=ddp_config, routing_replay=routing_replay,
                        mapping=mapping)
    load_weights_from(model, source, arch)
    return model


def load_weights_from(model: list[torch.nn.Module], source: str | Path, arch: HFArchitecture,
                      mapping: HFMapping | None = None) -> None:
    """Put the weights of `source` (an HF directory, read through `mapping`, or a torch_dist checkpoint written by
    vime_engine.convert) into this rank's built model."""
    if not is_converted_checkpoint(source):
        (mapping or RawMapping(arch)).load([unwrap(chunk) for chunk in model], source)
        return
    loaded = load_torch_dist(model_sharded_state_dict(model), Path(source) / TORCH_DIST_ITERATION_DIR)
    for i, chunk in enumerate(model):
        unwrap(chunk).load_state_dict(loaded["model" if len(model) == 1 else f"model{i}"])


def full_vocab_logits(output: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[b, s, V/TP] vocab-parallel logits → [b, s, V] (autograd-aware gather), Megatron's vocab padding cut off."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        output = tensor_parallel.gather_from_tensor_model_parallel_region(output)
    return output[..., :vocab_size]


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def model_sharded_state_dict(model: list[torch.nn.Module]) -> dict[str, Any]:
    if len(model) == 1:
        return {"model": unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def save_torch_dist(state: dict[str, Any], directory: Path) -> None:
    """Megatron's distributed checkpoint (torch_dist backend); collective over all ranks."""
    directory.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(directory))


def load_torch_dist(sharded_state: dict[str, Any], directory: Path) -> dict[str, Any]:
    return dist_checkpointing.load(sharded_state, str(directory))


def forward_logits(chunk: torch.nn.Module, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocab logits [b, s, V] of right-padded `input_ids` on a single pipeline stage (causal attention:
    real tokens never attend to the padding after them, so no padding mask is needed)."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    output = chunk(input_ids=input_ids, position_ids=positions, attention_mask=None)
    return full_vocab_logits(output, vocab_size)


def save_hf_weights(weights: dict[str, torch.Tensor], directory: Path) -> None:
    """HF safetensors files (sharded with an index past 5 GB), as `save_pretrained` lays them out."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    plan = split_torch_state_dict_into_shards(weights)
    for filename, names in plan.filename_to_tensors.items():
        save_file({n: weights[n].contiguous() for n in names}, directory / filename, metadata={"format": "pt"})
    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def hf_weight_stream(arch: HFArchitecture, model: list[torch.nn.Module], with_lm_head: bool,
                     mapping: HFMapping | None = None) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) of the full model through `mapping` (default: raw; collective over TP/PP ranks: every rank
    must iterate); with tied embeddings `lm_head.weight` too when `with_lm_head` (vLLM needs it)."""
    return (mapping or RawMapping(arch)).export([unwrap(chunk) for chunk in model], with_lm_head)
