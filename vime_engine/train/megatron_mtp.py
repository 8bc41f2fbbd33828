"""The multi-token-prediction (MTP) layers a DeepSeek-V3 or GLM-4.5 checkpoint ships and the policy does not train.

Such a checkpoint (config.json `num_nextn_predict_layers` = K > 0) stores its MTP layers after the decoder's, as
`model.layers.{L}.*` … `model.layers.{L+K-1}.*` (L = `num_hidden_layers`): enorm, hnorm, eh_proj, a whole decoder
layer, shared_head.norm / shared_head.head and a copy of the embedding. Only speculative decoding reads them (vLLM's
and SGLang's MTP drafts); the policy's log-probs never do, so, as slime does without `--mtp-num-layers`, the policy is
built without them and the RL loss does not touch them.

What this module keeps true: nothing is lost on the way out. The tensors are *carried*, bit for bit, from the
checkpoint the policy started from into every HF export (`--save-hf`, `vimeflow convert` torch_dist → HF), so an
exported directory holds the source's tensor set and still serves vLLM's MTP speculative decoding. A converted
checkpoint keeps them beside its torch_dist weights in MTP_TENSORS_FILE, since Megatron holds no parameter for them.
The weight sync leaves them out: vLLM's DeepSeek-V3 / GLM-4.5 loaders skip those layers in the main model, and a
draft that reads them keeps the checkpoint's, which is what they still are.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

from torch import Tensor

from vime_engine.train.megatron_hf import HFArchitecture, is_converted_checkpoint, safetensors_files

log = logging.getLogger(__name__)
MTP_TENSORS_FILE = "mtp_layers.safetensors"  # in a converted checkpoint, beside iter_0000000/
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def is_mtp_tensor(name: str, arch: HFArchitecture) -> bool:
    """Whether HF tensor `name` belongs to one of the model's MTP layers (numbered after its decoder layers)."""
    match = _LAYER.match(name)
    return match is not None and arch.num_layers <= int(match[1]) < arch.num_layers + arch.mtp_layers


@functools.cache
def say_mtp_skipped(source: str, mtp_layers: int) -> None:
    """Log, once a process for each checkpoint, that its MTP layers are left out of the policy and carried."""
    log.warning("%s: its %d multi-token-prediction layer(s) (num_nextn_predict_layers) are not built into the policy "
                "nor trained (--mtp-num-layers would train them; not wired here): their tensors are skipped on load "
                "and carried unchanged into --save-hf and vimeflow convert", source, mtp_layers)


def require_kept_mtp_tensors(source: str | Path, arch: HFArchitecture) -> None:
    """Raise FileNotFoundError, naming the file, when `source` is a converted checkpoint of a model with MTP layers
    whose MTP_TENSORS_FILE is missing (an export would lose them)."""
    path = Path(source) / MTP_TENSORS_FILE
    if arch.mtp_layers and is_converted_checkpoint(source) and not path.is_file():
        raise FileNotFoundError(f"{path}: missing; the checkpoint's config has {arch.mtp_layers} "
                                "multi-token-prediction layer(s), whose tensors a conversion keeps there: convert it "
                                "again from the HF model")


def carried_mtp_tensors(source: str | Path, arch: HFArchitecture) -> dict[str, Tensor]:
    """The MTP tensors of `source`, the checkpoint the model's weights came from: an HF directory (its safetensors
    files) or a converted checkpoint (its MTP_TENSORS_FILE); none for a model without MTP layers. Raises
    FileNotFoundError naming the file when a converted checkpoint lacks it."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not arch.mtp_layers:
        return {}
    source = Path(source)
    if is_converted_checkpoint(source):
        require_kept_mtp_tensors(source, arch)
        return load_file(source / MTP_TENSORS_FILE)
    files = safetensors_files(source)
    wanted = sorted(n for n in files if is_mtp_tensor(n, arch))
    tensors: dict[str, Tensor] = {}
    for path in sorted({files[n] for n in wanted}):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({n: f.get_tensor(n) for n in wanted if files[n] == path})
    return tensors
