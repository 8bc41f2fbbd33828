"""Building a Megatron-Core GPT model from an HF directory through Megatron-Bridge, and its torch_dist files.

Shared by the Megatron training backend and the checkpoint converter. Import this module only after
`vime_engine.runtime.devices.prepare_accelerator` ran: on Ascend, MindSpeed's adaptor must patch Megatron before
the first `megatron` import, and this module imports Megatron at the top.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.bridge import AutoBridge
from megatron.bridge.models.gpt_provider import local_layer_spec
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel

from vime_engine.runtime.devices import Accelerator

TORCH_DIST_ITERATION_DIR = "iter_0000000"
HF_CONFIG_DIR = "hf_config"  # config + tokenizer of the source HF model, kept beside the torch_dist weights


class MegatronSetupError(ValueError):
    """A Megatron parallel layout or setting this engine cannot run; the message names the flag."""


@dataclass(frozen=True)
class ParallelLayout:
    """Megatron's parallel flags (`cfg.megatron`, keyed by flag name) as typed values."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: int | None = None
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    attention_softmax_in_fp32: bool | None = None  # None: the provider's own choice
    attention_backend: str | None = None  # megatron.core.transformer.enums.AttnBackend name; None: Megatron's
    # Gradients reduced across data-parallel ranks in fp32 (exact reductions) unless turned off.
    grad_reduce_in_fp32: bool = True

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> ParallelLayout:
        layout = cls(
            tensor=int(flags.get("tensor-model-parallel-size") or 1),
            pipeline=int(flags.get("pipeline-model-parallel-size") or 1),
            context=int(flags.get("context-parallel-size") or 1),
            expert=int(flags.get("expert-model-parallel-size") or 1),
            expert_tensor=flags.get("expert-tensor-parallel-size"),
            sequence_parallel=bool(flags.get("sequence-parallel", False)),
            recompute_granularity=flags.get("recompute-granularity"),
            recompute_method=flags.get("recompute-method"),
            recompute_num_layers=flags.get("recompute-num-layers"),
            # RL needs the same function for old and new log-probs: dropout off unless asked for.
            attention_dropout=float(flags.get("attention-dropout") or 0.0),
            hidden_dropout=float(flags.get("hidden-dropout") or 0.0),
            attention_softmax_in_fp32=flags.get("attention-softmax-in-fp32"),
            attention_backend=flags.get("attention-backend"),
            grad_reduce_in_fp32=flags.get("accumulate-allreduce-grads-in-fp32", True),
        )
        if layout.attention_backend is not None:
            from megatron.core.transformer.enums import AttnBackend

            if layout.attention_backend not in AttnBackend.__members__:
                raise MegatronSetupError(
                    f"--attention-backend {layout.attention_backend!r}: expected one of "
                    f"{', '.join(AttnBackend.__members__)}"
                )
        if layout.context != 1:
            raise MegatronSetupError(
                "--context-parallel-size > 1 is not supported yet by the Megatron backend "
                "(it trains on padded batches; context parallelism needs sequence-split packing)"
            )
        if layout.sequence_parallel and layout.tensor == 1:
            raise MegatronSetupError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        return layout

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline * self.context


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


def hf_bridge(hf_dir: str | Path, dtype: torch.dtype) -> AutoBridge:
    return AutoBridge.from_hf_pretrained(str(hf_dir), dtype=dtype)


def build_model(
    bridge: AutoBridge,
    layout: ParallelLayout,
    dtype: torch.dtype,
    accelerator: Accelerator,
    load_weights: bool = True,
    ddp_config: Any = None,
) -> list[torch.nn.Module]:
    """The Megatron model chunks for this rank, with the bridge's HF weights loaded when asked.

    Transformer Engine layers when TE is installed (CUDA images), Megatron's local layers otherwise (CPU tests,
    Ascend through MindSpeed's patches).
    """
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    if importlib.util.find_spec("transformer_engine") is None:
        provider.transformer_layer_spec = local_layer_spec
        # Fused kernels that need TE / Apex (Llama providers turn them on); the local layers reject them.
        provider.apply_rope_fusion = False
        provider.persist_layer_norm = False
        provider.gradient_accumulation_fusion = False
    provider.tensor_model_parallel_size = layout.tensor
    provider.pipeline_model_parallel_size = layout.pipeline
    provider.context_parallel_size = layout.context
    provider.expert_model_parallel_size = layout.expert
    if layout.expert_tensor is not None:
        provider.expert_tensor_parallel_size = layout.expert_tensor
    provider.sequence_parallel = layout.sequence_parallel
    provider.attention_dropout = layout.attention_dropout
    provider.hidden_dropout = layout.hidden_dropout
    if layout.attention_softmax_in_fp32 is not None:
        provider.attention_softmax_in_fp32 = layout.attention_softmax_in_fp32
    if layout.attention_backend is not None:
        from megatron.core.transformer.enums import AttnBackend

        provider.attention_backend = AttnBackend[layout.attention_backend]
    if layout.recompute_granularity is not None:
        provider.recompute_granularity = layout.recompute_granularity
        provider.recompute_method = layout.recompute_method
        provider.recompute_num_layers = layout.recompute_num_layers
    provider.params_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = dtype == torch.float16
    # Micro-batches are padded to their own longest sample, so pipeline stages exchange varying shapes.
    provider.variable_seq_lengths = layout.pipeline > 1
    provider.finalize()
    return provider.provide_distributed_model(
        ddp_config=ddp_config,
        wrap_with_ddp=ddp_config is not None,
        fp16=provider.fp16,
        bf16=provider.bf16,
        use_cpu_initialization=accelerator.kind == "cpu",
    )


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
    """HF safetensors files (sharded with an index past 5 GB), as `save_pretrained` lays them out.

    Megatron-Bridge's own `save_hf_pretrained` needs NVIDIA ModelOpt; this writes the same files from the
    `export_hf_weights` stream without it.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    plan = split_torch_state_dict_into_shards(weights)
    for filename, names in plan.filename_to_tensors.items():
        save_file({n: weights[n].contiguous() for n in names}, directory / filename, metadata={"format": "pt"})
    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


_TIED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def hf_weight_stream(bridge: AutoBridge, model: list[torch.nn.Module], with_lm_head: bool):
    """(HF name, tensor) of the full model (collective over TP/PP ranks: every rank must iterate).

    With tied embeddings Megatron-Bridge exports the shared matrix under one of its two HF names, depending on
    the architecture; this stream always names it `model.embed_tokens.weight` and, when `with_lm_head` (vLLM
    needs it), also yields it as `lm_head.weight` right after.
    """
    hf_config = getattr(bridge.hf_pretrained, "config", bridge.hf_pretrained)  # a bridge built from a config
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    shared_done = False
    for name, tensor in bridge.export_hf_weights(model, cpu=False, show_progress=False):
        if not (tied and name in _TIED_NAMES):
            yield name, tensor
            continue
        if shared_done:
            continue
        shared_done = True
        yield _TIED_NAMES[0], tensor
        if with_lm_head:
            yield _TIED_NAMES[1], tensor
