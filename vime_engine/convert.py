"""HF <-> Megatron (torch_dist) checkpoint conversion, verified by a round trip: through the engine's own mapping
(vime_engine.train.megatron_hf, `--megatron-to-hf-mode raw`) or Megatron-Bridge's AutoBridge (`bridge`,
vime_engine.train.megatron_bridge), which write the same torch_dist layout.

HF → Megatron writes `<dest>/iter_0000000/` (Megatron's distributed checkpoint, torch_dist backend, the model's
sharded state dict under "model"), `latest_checkpointed_iteration.txt`, and `<dest>/hf_config/` (the source's
config and tokenizer, so the way back needs nothing else); for a checkpoint with multi-token-prediction layers, which
the Megatron model does not hold (train/megatron_mtp.py), their tensors unchanged in `<dest>/mtp_layers.safetensors`.
Megatron → HF writes an ordinary HF directory, those tensors carried back into it.

Verification reloads what was written into a fresh model and requires (1) every exported (or carried) HF tensor
equal to the source's and (2) the per-token log-probs of a fixed batch equal between the HF model and the Megatron
model within `LOGPROB_TOLERANCE` (fp32; decided in float64 when a deep model's fp32 rounding alone exceeds
it). `conversion.json` is written last, with the source's content hash and the mode: a destination holding it for
the same source is complete and the conversion is skipped (idempotent; in either mode, the layouts being the same).

Runs in one process (tensor and pipeline parallel size 1); the weights land on the CPU.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from vime_engine.devices.accelerator import CPU, Accelerator, prepare_accelerator
from vime_engine.train.megatron_hf import MARKER, copy_non_weight_files
from vime_engine.train.megatron_layout import MegatronToHFMode
from vime_engine.train.megatron_mtp import MTP_TENSORS_FILE, carried_mtp_tensors, require_kept_mtp_tensors

Direction = Literal["hf_to_megatron", "megatron_to_hf"]
LOGPROB_TOLERANCE = 1e-5


class ConversionError(RuntimeError):
    """The converted checkpoint does not reproduce the source; nothing was marked complete."""


@dataclass(frozen=True)
class ConversionResult:
    direction: Direction
    source: str
    dest: str
    source_hash: str
    max_tensor_abs_diff: float
    max_logprob_abs_diff_fp32: float
    max_logprob_abs_diff: float  # the one checked: fp32, or float64 where fp32 rounding exceeds the tolerance
    skipped: bool = False
    megatron_to_hf_mode: MegatronToHFMode = "raw"  # the mapping that converted (markers written before the flag: raw)


def directory_hash(directory: Path) -> str:
    """sha256 over every file's relative path and bytes, in sorted order (the marker file excluded)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MARKER):
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def convert_checkpoint(
    source: str | Path, dest: str | Path, direction: Direction, accelerator: Accelerator = CPU,
    mode: MegatronToHFMode = "raw",
) -> ConversionResult:
    """Convert `source` into `dest` through `mode`'s mapping (skipped when `dest` already holds a verified
    conversion of it)."""
    source, dest = Path(source), Path(dest)
    if not source.is_dir():
        raise FileNotFoundError(f"conversion source {source} is not a directory")
    source_hash = directory_hash(source)
    done = _completed(dest, direction, source_hash)
    if done is not None:
        return done
    prepare_accelerator(accelerator)
    from vime_engine.train import megatron_model as mm  # after prepare_accelerator: MindSpeed patches first

    mm.init_distributed(accelerator, mm.ParallelLayout(), seed=0)
    if dest.exists():
        shutil.rmtree(dest)  # an unmarked destination is a crashed attempt
    if direction == "hf_to_megatron":
        diffs = _hf_to_megatron(mm, source, dest, accelerator, mode)
    elif direction == "megatron_to_hf":
        diffs = _megatron_to_hf(mm, source, dest, accelerator, mode)
    else:
        raise ValueError(f"direction {direction!r}: expected hf_to_megatron or megatron_to_hf")
    result = ConversionResult(direction, str(source), str(dest), source_hash, *diffs, megatron_to_hf_mode=mode)
    (dest / MARKER).write_text(json.dumps(asdict(result), indent=2))
    return result


def _completed(dest: Path, direction: Direction, source_hash: str) -> ConversionResult | None:
    marker = dest / MARKER
    if not marker.is_file():
        return None
    recorded = json.loads(marker.read_text())
    if recorded.get("direction") != direction or recorded.get("source_hash") != source_hash:
        return None
    return ConversionResult(**{**recorded, "skipped": True})


def _hf_to_megatron(mm, source: Path, dest: Path, accelerator: Accelerator,
                    mode: MegatronToHFMode) -> tuple[float, float, float]:
    arch = mm.HFArchitecture.from_pretrained(source, bridge=mode == "bridge")
    mapping = mm.hf_mapping(mode, arch, source)
    model = mm.build_model(arch, mm.ParallelLayout(), torch.float32, accelerator, hf_dir=source, mapping=mapping)
    mm.save_torch_dist(mm.model_sharded_state_dict(model), dest / mm.TORCH_DIST_ITERATION_DIR)
    (dest / "latest_checkpointed_iteration.txt").write_text("0")
    copy_non_weight_files(source, dest / mm.HF_CONFIG_DIR)
    if arch.mtp_layers:
        save_file(carried_mtp_tensors(source, arch), dest / MTP_TENSORS_FILE, metadata={"format": "pt"})
    del model

    reloaded = mm.build_model(arch, mm.ParallelLayout(), torch.float32, accelerator, mapping=mapping)
    mm.load_torch_dist(mm.model_sharded_state_dict(reloaded), dest / mm.TORCH_DIST_ITERATION_DIR)
    return _verify(mm, arch, reloaded, source, mapping, carried_mtp_tensors(dest, arch))


def _megatron_to_hf(mm, source: Path, dest: Path, accelerator: Accelerator,
                    mode: MegatronToHFMode) -> tuple[float, float, float]:
    hf_config_dir = source / mm.HF_CONFIG_DIR
    if not (source / mm.TORCH_DIST_ITERATION_DIR).is_dir() or not hf_config_dir.is_dir():
        raise FileNotFoundError(
            f"{source} is not a converted Megatron checkpoint: expected {mm.TORCH_DIST_ITERATION_DIR}/ and "
            f"{mm.HF_CONFIG_DIR}/ (write one with direction hf_to_megatron)"
        )
    arch = mm.HFArchitecture.from_pretrained(hf_config_dir, bridge=mode == "bridge")
    require_kept_mtp_tensors(source, arch)
    mapping = mm.hf_mapping(mode, arch, hf_config_dir)
    model = mm.build_model(arch, mm.ParallelLayout(), torch.float32, accelerator, mapping=mapping)
    mm.load_torch_dist(mm.model_sharded_state_dict(model), source / mm.TORCH_DIST_ITERATION_DIR)
    weights = {name: t.cpu() for name, t in mm.hf_weight_stream(arch, model, with_lm_head=False, mapping=mapping)}
    carried = carried_mtp_tensors(source, arch)
    mm.save_hf_weights({**weights, **carried}, dest)
    copy_non_weight_files(hf_config_dir, dest)
    return _verify(mm, arch, model, dest, mapping, carried)


def hf_files_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory's safetensors files, by the name it is stored under."""
    from safetensors.torch import load_file

    from vime_engine.train.megatron_hf import safetensors_files

    return {name: tensor for path in sorted(set(safetensors_files(hf_dir).values()))
            for name, tensor in load_file(path).items()}


def _verify(mm, arch, model, hf_dir: Path, mapping, carried: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """Max |difference| of tensors exported through `mapping`, and of the multi-token-prediction tensors `carried`
    beside the model (megatron_mtp), vs HF's, and of fixed-batch log-probs (fp32, checked); raises past the
    tolerances."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    # The tensors as the HF files name them: transformers 5 fuses a MoE layer's experts into 3-D parameters in
    # memory, while its files (and vLLM) keep one tensor per expert.
    hf_state = hf_files_state(hf_dir)
    tensor_diff = 0.0
    exported = set()
    for name, tensor in mm.hf_weight_stream(arch, model, with_lm_head=False, mapping=mapping):
        exported.add(name)
        if name not in hf_state:
            raise ConversionError(f"exported tensor {name} does not exist in the HF model at {hf_dir}")
        if tensor.shape != hf_state[name].shape:
            raise ConversionError(f"{name}: shape {tuple(tensor.shape)} != HF {tuple(hf_state[name].shape)}")
        tensor_diff = max(tensor_diff, (tensor.float() - hf_state[name].float()).abs().max().item())
    for name, tensor in carried.items():  # stored, not computed: equal bit for bit
        exported.add(name)
        if name not in hf_state or not torch.equal(tensor, hf_state[name]):
            raise ConversionError(f"carried multi-token-prediction tensor {name} is missing from or differs from the "
                                  f"HF model at {hf_dir}")
    missing = set(hf_state) - exported
    if missing:
        raise ConversionError(f"tensors missing from the Megatron checkpoint: {sorted(missing)[:5]}")
    if tensor_diff != 0.0:
        raise ConversionError(f"exported tensors differ from {hf_dir} by up to {tensor_diff:.3e}")

    vocab = hf_model.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    chunk = model[0].eval()

    def max_logprob_diff() -> float:
        with torch.no_grad():
            reference = torch.log_softmax(hf_model(input_ids=tokens).logits.double(), dim=-1)
            ours = torch.log_softmax(mm.forward_logits(chunk, tokens, vocab).double(), dim=-1)
        picked = lambda lp: lp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)  # noqa: E731
        return (picked(reference) - picked(ours)).abs().max().item()

    fp32_diff = max_logprob_diff()
    # fp32 kernels of the two implementations round differently: past ~1e-5 (deep models) the decision is made
    # in float64, where any difference is a mapping error rather than rounding.
    logprob_diff = fp32_diff
    if fp32_diff > LOGPROB_TOLERANCE:
        hf_model.double()
        chunk.double()
        logprob_diff = max_logprob_diff()
    if logprob_diff > LOGPROB_TOLERANCE:
        raise ConversionError(
            f"log-probs of the converted model differ from HF by {logprob_diff:.3e} > {LOGPROB_TOLERANCE} "
            f"(fp32: {fp32_diff:.3e})"
        )
    return tensor_diff, fp32_diff, logprob_diff
