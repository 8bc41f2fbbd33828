"""Checks of everything a run reads, made before any worker starts.

A mistake in the model directory, a checkpoint or any row of a dataset would otherwise surface seconds or
minutes later inside a Ray actor or vLLM, as a traceback. `preflight(cfg)` reads them all first: the training
backend's packages, the model and reference directories (config.json, every safetensors header against its file's
size, the context against the length flags), `--load`, `--save` and the checkpoint a run would resume from, the
custom functions it would import, and every row of the training and eval datasets (keys, types, empty prompts,
labels the reward can grade, prompts that render and fit the model's context). Each failure is a
`PreflightError`, a `ConfigError`: one message naming the flag, file or row and the fix.

The two halves can run apart: `check_inputs` takes a moment (it reads the rows too, without a tokenizer: a missing
file, bad JSON or a missing key needs none), `check_datasets` seconds (the tokenizer), so the driver runs the
first before Ray starts and the second while Ray starts.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import struct
from pathlib import Path
from typing import Any, NamedTuple

from vime_engine.checkpoint import store as ckpt
from vime_engine.config import ConfigError, EngineConfig
from vime_engine.data.datasets import DatasetError, NumberedRecord, read_prompt_rows
from vime_engine.data.prompt_length import FLAG as MAX_PROMPT_FLAG
from vime_engine.data.prompt_length import load_tokenizer, prompt_lengths, short_enough
from vime_engine.devices.accelerator import cpu_thread_limit
from vime_engine.rewards.labels import label_problem
from vime_engine.rollout.routed_experts import routed_experts_unavailable
from vime_engine.train.megatron_model_flags import HFView, ModelFlagMismatch, check_expert_layout, check_model_flags

log = logging.getLogger(__name__)
MEGATRON_MODULES = ("megatron.core",)  # the raw HF mapping is our own (train/megatron_hf.py)
MEGATRON_BRIDGE_MODULE = "megatron.bridge"  # --megatron-to-hf-mode bridge (train/megatron_bridge.py)
CHECKPOINT_WEIGHTS = "model.safetensors"  # the torch backend's weights inside rollout_NNNNNNN/
# One of these holds a tokenizer's vocabulary (fast, sentencepiece, or BPE vocab + merges).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class PreflightError(ConfigError):
    """Input that cannot train; the message names the flag, file or row and the fix."""


def preflight(cfg: EngineConfig) -> None:
    """Refuse the run now, with one message, if anything it reads is missing or malformed."""
    check_inputs(cfg)
    check_datasets(cfg)


OUTPUT_DIR_HOLDS = "the run's logs and metrics"


def check_inputs(cfg: EngineConfig) -> None:
    """Everything the tokenizer is not needed for: the packages, the model (its config.json, its weights' headers
    and its context against the length flags), checkpoints, plugins, and every dataset row's keys and types (fast:
    no tokenizer is loaded, no tensor read)."""
    if cfg.train.train_backend == "megatron":
        require_megatron()
        if cfg.train.megatron_to_hf_mode == "bridge":
            require_megatron_bridge()
    model_config = check_model_dir(cfg.model.hf_checkpoint, "--hf-checkpoint")
    config_file = Path(cfg.model.hf_checkpoint) / "config.json"
    _check_model_flags(cfg.megatron, model_config, config_file, cfg.algorithm.moe_aux_loss_coeff)
    _check_moe_aux_loss(cfg.algorithm.moe_aux_loss_coeff, model_config, config_file)
    _check_routing_replay(cfg, model_config, config_file)
    _check_context_limits(cfg, model_config, config_file)
    _check_engine_tensor_parallel(cfg.rollout.rollout_num_gpus_per_engine, model_config, config_file)
    ref_load = cfg.checkpoint.ref_load
    torch_dist_ref = ref_load is not None and _is_converted_checkpoint(ref_load)
    if torch_dist_ref:
        _check_torch_dist_ref(cfg)
    elif ref_load is not None:
        check_model_dir(ref_load, "--ref-load")
    if cfg.train.train_backend == "megatron":
        _check_megatron_settings(cfg.megatron, model_config, config_file)
        mode = cfg.train.megatron_to_hf_mode
        check_megatron_mapping(cfg.model.hf_checkpoint, "--hf-checkpoint", mode)
        if ref_load is not None and not torch_dist_ref:
            check_megatron_mapping(ref_load, "--ref-load", mode)
    _check_plugins(cfg)
    _check_checkpoints(cfg)
    check_can_make_dir(Path(cfg.logging.output_dir), "--output-dir", OUTPUT_DIR_HOLDS)
    for dataset in _datasets(cfg):
        _read_rows(dataset)


def _check_engine_tensor_parallel(per_engine: int, model_config: dict[str, Any], config_file: Path) -> None:
    """vLLM splits the attention heads evenly over an engine's devices: refused here, before Ray starts, instead of
    by the engine once every actor has started."""
    heads = model_config.get("num_attention_heads")
    if per_engine > 1 and isinstance(heads, int) and heads % per_engine:
        raise PreflightError(
            f"--rollout-num-gpus-per-engine {per_engine}: the model's {heads} attention heads ({config_file}: "
            f"num_attention_heads) do not split over {per_engine} devices; use a divisor of {heads}")


def check_datasets(cfg: EngineConfig) -> None:
    """Every row of the training and eval datasets, tokenized with the model's tokenizer (seconds: loading the
    tokenizer imports transformers and torch)."""
    tokenizer = _tokenizer(cfg.model.hf_checkpoint)
    model_config = check_model_dir(cfg.model.hf_checkpoint, "--hf-checkpoint")
    context = cfg.rollout.vllm_max_model_len or _max_positions(model_config)
    for dataset in _datasets(cfg):
        _check_dataset(cfg, dataset, tokenizer, context)


class _Dataset(NamedTuple):
    """A dataset the run reads, with what it is read with."""
    flag: str  # how messages name it: `--prompt-data`, `--eval-prompt-data NAME`
    path: str
    keys: tuple[str, str, str | None, str]  # input, label and metadata keys; the prefix of their flags
    rm_type: str | None  # the built-in reward grading it (None: a custom one)
    response_len: int


def _datasets(cfg: EngineConfig) -> list[_Dataset]:
    """The training set and every eval set: each gets the same checks, at the same time."""
    d, e = cfg.data, cfg.eval
    train_rm = None if cfg.reward.custom_rm_path else cfg.reward.rm_type  # a custom reward takes precedence
    response_len = cfg.rollout.rollout_max_response_len
    return [
        _Dataset("--prompt-data", d.prompt_data, (d.input_key, d.label_key, d.metadata_key, "--"), train_rm,
                 response_len),
        *(_Dataset(f"--eval-prompt-data {name}", path,
                   (e.eval_input_key or d.input_key, e.eval_label_key or d.label_key, None, "--eval-"),
                   e.eval_rm_type or train_rm, e.eval_max_response_len or response_len)
          for name, path in cfg.eval_datasets),
    ]


def _read_rows(dataset: _Dataset) -> list[NumberedRecord]:
    """Every row of `dataset`: the file is there, each row parses, has its keys with values of the right types and
    a prompt that is not empty (datasets.read_prompt_rows)."""
    try:
        return read_prompt_rows(dataset.path, *dataset.keys)
    except DatasetError as exc:
        raise PreflightError(f"{dataset.flag}: {exc}") from None


def _check_context_limits(cfg: EngineConfig, model_config: dict[str, Any], config_file: Path) -> None:
    """The length flags fit the model's context: `max_position_embeddings`, what the engine gives vLLM unless
    --vllm-max-model-len is set (those against --vllm-max-model-len: config/checks.py). vime checks none of them;
    vLLM cuts every response at the context in silence, and refuses a longer --vllm-max-model-len only inside a
    worker. Refused here instead, naming the flag and the limit."""
    model_context = _max_positions(model_config)
    if model_context is None:
        return
    r, e = cfg.rollout, cfg.eval
    limit = f"the model's context of {model_context} tokens (max_position_embeddings in {config_file})"
    if r.vllm_max_model_len is not None:
        if r.vllm_max_model_len > model_context and not _rope_scaled(model_config):
            raise PreflightError(f"--vllm-max-model-len {r.vllm_max_model_len} is beyond {limit}; give at most "
                                 f"{model_context}, or leave it out")
        return
    for flag, value in (("--rollout-max-response-len", r.rollout_max_response_len),
                        ("--eval-max-response-len", e.eval_max_response_len)):
        if value is not None and value >= model_context:
            raise PreflightError(f"{flag} {value} leaves no room for the prompt within {limit}; give less than "
                                 f"{model_context}")
    if r.rollout_max_context_len is not None and r.rollout_max_context_len > model_context:
        raise PreflightError(f"--rollout-max-context-len {r.rollout_max_context_len} is beyond {limit}; give at most "
                             f"{model_context}")


def _rope_scaled(model_config: dict[str, Any]) -> bool:
    """Whether the config stretches RoPE past max_position_embeddings (YaRN, linear, dynamic): vLLM then accepts a
    --vllm-max-model-len up to the stretched length."""
    for section in (model_config, model_config.get("text_config") or {}):
        for key in ("rope_scaling", "rope_parameters"):
            scaling = section.get(key)
            if isinstance(scaling, dict) and scaling.get("factor") not in (None, 1, 1.0):
                return True
    return False


def module_available(name: str) -> bool:
    """Whether `name` can be imported; `find_spec("a.b")` raises instead of answering when `a` is absent."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def require_megatron() -> None:
    missing = [m for m in MEGATRON_MODULES if not module_available(m)]
    if missing:
        raise PreflightError(
            f"--train-backend megatron needs {' and '.join(m.replace('.', '-') for m in missing)}, which this "
            "environment lacks: install it (scripts/ensure-venv and scripts/ensure-venv-megatron do), use the "
            "CUDA / NPU image, or train with --train-backend torch here"
        )


def require_megatron_bridge() -> None:
    """`--megatron-to-hf-mode bridge` needs Megatron-Bridge (Python >= 3.12): refused before anything starts."""
    if not module_available(MEGATRON_BRIDGE_MODULE):
        raise PreflightError(
            "--megatron-to-hf-mode bridge needs megatron-bridge, which this environment lacks: install it beside "
            "megatron-core >= 0.17 on Python >= 3.12 (`pip install --no-deps megatron-bridge==0.6.2` and its "
            "pure-Python needs, as scripts/ensure-venv-megatron does), use the CUDA image, or keep "
            "--megatron-to-hf-mode raw (the engine's own mapping, the same tensors)")


def _is_converted_checkpoint(path: str) -> bool:
    from vime_engine.train.megatron_hf import is_converted_checkpoint

    return is_converted_checkpoint(path)


def _check_torch_dist_ref(cfg: EngineConfig) -> None:
    """A converted torch_dist --ref-load (the Megatron policy's initial weights) holds --hf-checkpoint's model."""
    from vime_engine.train.megatron_hf import HFArchitecture, architecture_of

    ref_load = cfg.checkpoint.ref_load
    if cfg.train.train_backend != "megatron":
        raise PreflightError(
            f"--ref-load {ref_load} is a Megatron torch_dist checkpoint, which only --train-backend megatron reads; "
            "give the torch backend an HF directory (vimeflow convert --direction megatron_to_hf writes one)")
    bridge = cfg.train.megatron_to_hf_mode == "bridge"
    ref_arch = architecture_of(ref_load, bridge=bridge)
    hf_arch = HFArchitecture.from_pretrained(cfg.model.hf_checkpoint, bridge=bridge)
    if ref_arch != hf_arch:
        differ = [f"{k} {v} vs {getattr(hf_arch, k)}" for k, v in vars(ref_arch).items() if getattr(hf_arch, k) != v]
        raise PreflightError(
            f"--ref-load {ref_load} holds another model than --hf-checkpoint {cfg.model.hf_checkpoint} "
            f"({', '.join(differ)}); convert --hf-checkpoint's model (vimeflow convert) and give that")


def check_megatron_mapping(path: str, flag: str, mode: str) -> None:
    """The Megatron backend builds this architecture (a family or setting it would get wrong is named); with
    --megatron-to-hf-mode bridge, Megatron-Bridge builds the families our mapping lacks."""
    from vime_engine.train.megatron_hf import HFArchitecture, UnsupportedHFModel

    try:
        HFArchitecture.from_pretrained(path, bridge=mode == "bridge")
    except UnsupportedHFModel as exc:
        raise PreflightError(f"{flag} {exc}") from None


def _check_model_flags(flags: dict[str, Any], model_config: dict[str, Any], config_file: Path,
                       aux_loss_coeff: float) -> None:
    """vime's model-architecture flags (--num-layers, --hidden-size, …) agree with the model's config.json."""
    try:
        check_model_flags(flags, model_config, str(config_file), aux_loss_coeff)
    except ModelFlagMismatch as exc:
        raise PreflightError(str(exc)) from None


def _check_megatron_settings(flags: dict[str, Any], model_config: dict[str, Any], config_file: Path) -> None:
    """Megatron's MoE settings read as the backend reads them, and its expert-parallel flags fit the model's experts
    (vime_engine/train/megatron_layout.py, megatron_model_flags.py): refused here, not in a rank after Ray started.
    Nothing of Megatron is imported (on Ascend MindSpeed must patch it first, in the process that trains)."""
    from vime_engine.train.megatron_layout import MegatronSetupError, MoESettings

    try:
        MoESettings.from_flags(flags)
        check_expert_layout(flags, model_config, str(config_file))
    except (ModelFlagMismatch, MegatronSetupError) as exc:
        raise PreflightError(str(exc)) from None


def _check_moe_aux_loss(coefficient: float, model_config: dict[str, Any], config_file: Path) -> None:
    """A load-balancing loss weight needs a model with routed experts."""
    if coefficient > 0 and not HFView(model_config).num_experts:
        raise PreflightError(f"--moe-aux-loss-coeff {coefficient}: the model has no experts to balance (no "
                             f"num_experts in {config_file}); drop the flag or give a mixture-of-experts model")


def _check_routing_replay(cfg: EngineConfig, model_config: dict[str, Any], config_file: Path) -> None:
    """Routing replay needs a mixture-of-experts model whose router the trainer can replay."""
    flag = cfg.algorithm.routing_replay_flag
    if flag is None:
        return
    if not HFView(model_config).num_experts:
        raise PreflightError(f"{flag}: the model has no experts to route (no num_experts in {config_file}); drop "
                             "the flag or give a mixture-of-experts model")
    if cfg.train.train_backend == "megatron":  # Megatron's own router replay, in every router its mapping builds
        from vime_engine.train.megatron_layout import MegatronSetupError
        from vime_engine.train.megatron_routing_replay import check_replay_layout

        try:
            check_replay_layout(cfg.megatron, flag)
        except MegatronSetupError as exc:
            raise PreflightError(str(exc)) from None
        return
    from vime_engine.train.routing_replay import REPLAYABLE_MODEL_TYPES  # imports torch: only for a run that replays

    model_type = model_config.get("model_type")
    if model_type not in REPLAYABLE_MODEL_TYPES:
        raise PreflightError(f"{flag}: the torch backends replay the router of {', '.join(REPLAYABLE_MODEL_TYPES)} "
                             f"models; {config_file} has model_type {model_type!r}")


def check_on_device(cfg: EngineConfig, device_kind: str) -> None:
    """What the run's device cannot do, refused once the device is known and before Ray starts."""
    if cfg.algorithm.use_rollout_routing_replay and (why := routed_experts_unavailable(device_kind)):
        raise PreflightError(f"--use-rollout-routing-replay: {why}; --use-routing-replay replays the trainer's own "
                             "old-policy routing instead")
    if cfg.train.train_backend == "megatron" and cfg.model.dtype != "float32" and device_kind == "cpu":
        raise PreflightError(
            f"--dtype {cfg.model.dtype} with --train-backend megatron on CPU: megatron-core's mixed-precision "
            "optimizer (Float16OptimizerWithFloat16Params) takes CUDA tensors only; train in float32 on CPU "
            "(--dtype float32), or with --train-backend torch, which trains half precision on CPU")
    if device_kind == "cpu":
        try:
            cpu_thread_limit()
        except ValueError as error:
            raise PreflightError(str(error)) from None


def check_model_dir(path: str, flag: str) -> dict[str, Any]:
    """The model's config.json, after checking `path` is a local HF model directory with weights."""
    directory = Path(path)
    fix = "give a local HF model directory (config.json, weights and tokenizer files, as save_pretrained writes)"
    if not directory.exists():
        raise PreflightError(f"{flag} {path}: no such directory; {fix}, or builtin://tiny-qwen3")
    if not directory.is_dir():
        raise PreflightError(f"{flag} {path}: a file, not a directory; {fix}")
    config_file = directory / "config.json"
    if not config_file.is_file():
        found = ", ".join(sorted(p.name for p in directory.iterdir())[:8]) or "nothing"
        raise PreflightError(f"{flag} {path}: no config.json, so not an HF model directory (found: {found}); {fix}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise PreflightError(f"{flag} {config_file}: not valid JSON ({exc}); restore the model's config.json") from None
    if not isinstance(config, dict):
        raise PreflightError(f"{flag} {config_file}: expected a JSON object; restore the model's config.json")
    if not any(directory.glob("*.safetensors")) and not any(directory.glob("pytorch_model*.bin")):
        raise PreflightError(f"{flag} {path}: no weights (*.safetensors or pytorch_model*.bin); {fix}")
    _check_weight_files(directory, flag)
    return config


class DamagedSafetensors(ValueError):
    """A safetensors file whose bytes do not match its own header (truncated, cut short, or not safetensors)."""


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensors a safetensors file declares (name → dtype, shape, data_offsets), from its header alone.

    The format is an 8-byte little-endian header length, that many bytes of JSON, then the tensor data, whose
    extent is the largest end offset in the header: a complete file is exactly 8 + header + data bytes. Checking
    that costs a stat and a read of the header, where loading the tensors would find a truncated download only
    inside a worker. Raises DamagedSafetensors saying what does not add up."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise DamagedSafetensors(f"{size} bytes, too short for the 8-byte header length")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise DamagedSafetensors(f"{size} bytes, but its header length says {header_len} bytes of header follow")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except ValueError:  # UnicodeDecodeError is one
        raise DamagedSafetensors(f"its {header_len}-byte header is not valid JSON") from None
    not_a_header = DamagedSafetensors("its header is not a safetensors header (tensor name → dtype, shape, "
                                      "data_offsets)")
    if not isinstance(header, dict):
        raise not_a_header
    tensors = {name: spec for name, spec in header.items() if name != "__metadata__"}
    try:
        data_end = max((spec["data_offsets"][1] for spec in tensors.values()), default=0)
    except (TypeError, KeyError, IndexError):
        raise not_a_header from None
    if not isinstance(data_end, int):
        raise not_a_header
    expected = 8 + header_len + data_end
    if size != expected:
        raise DamagedSafetensors(f"{size} bytes, but its header declares {expected} (8 + {header_len} of header + "
                                 f"{expected - 8 - header_len} of tensor data)")
    return tensors


def _check_weight_files(directory: Path, flag: str) -> None:
    """Every safetensors file of the model holds the bytes its header declares, and every shard the index names is
    there: a download or conversion cut short is refused before any worker loads it."""
    fix = "download (or convert) the model again"
    for file in sorted(directory.glob("*.safetensors")):
        try:
            safetensors_header(file)
        except DamagedSafetensors as exc:
            raise PreflightError(f"{flag} {file}: truncated or corrupt ({exc}); {fix}") from None
        except OSError as exc:
            raise PreflightError(f"{flag} {file}: cannot read it ({exc.strerror or exc}); {fix}") from None
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise PreflightError(f"{flag} {index}: not a safetensors index (a JSON object with a weight_map); {fix}") \
                from None
        missing = sorted(str(s) for s in shards if not (directory / str(s)).is_file())
        if missing:
            raise PreflightError(f"{flag} {directory}: {index.name} names {len(missing)} file(s) that are not there "
                                 f"({', '.join(missing[:3])}); {fix}")


def _max_positions(model_config: dict[str, Any]) -> int | None:
    for section in (model_config, model_config.get("text_config") or {}):
        if isinstance(section.get("max_position_embeddings"), int):
            return section["max_position_embeddings"]
    return None


def _tokenizer(model_dir: str) -> Any:
    fix = "the directory needs the tokenizer files save_pretrained writes (tokenizer.json, tokenizer_config.json)"
    # Without them transformers 5 quietly builds an empty tokenizer that turns every prompt into no tokens.
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise PreflightError(f"--hf-checkpoint {model_dir}: no tokenizer ({', '.join(TOKENIZER_FILES)}); {fix}")
    try:
        return load_tokenizer(model_dir)
    except Exception as exc:  # noqa: BLE001  (transformers raises OSError, ValueError, KeyError … for bad files)
        raise PreflightError(
            f"--hf-checkpoint {model_dir}: cannot load its tokenizer ({type(exc).__name__}: {exc}); {fix}"
        ) from None


def _check_plugins(cfg: EngineConfig) -> None:
    """The reward types exist, and the user's functions (the reward and vime's hooks) import with the signatures
    their flags call them with: a typo fails here, not in a worker."""
    from vime_engine.rewards import BUILTIN_REWARDS, REMOTE_RM, run_reward
    from vime_engine.rollout.vime_hooks import load_rollout_hooks
    from vime_engine.train.vime_hooks import load_trainer_hooks

    known = [*BUILTIN_REWARDS, REMOTE_RM]
    train_rm = None if cfg.reward.custom_rm_path else cfg.reward.rm_type  # a custom reward takes precedence
    for flag, rm_type in (("--rm-type", train_rm), ("--eval-rm-type", cfg.eval.eval_rm_type)):
        if rm_type is not None and rm_type not in known:
            raise PreflightError(f"{flag} {rm_type!r} is unknown; choose one of {', '.join(known)}, or give your "
                                 "own function with --custom-rm-path")

    try:
        if cfg.reward.custom_rm_path:
            run_reward(cfg)
        load_rollout_hooks(cfg)
        load_trainer_hooks(cfg)
        if cfg.rollout.custom_generate_function_path:
            from vime_engine.rollout.custom_generate import load_generate_function

            load_generate_function(cfg.rollout.custom_generate_function_path)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None


def _check_checkpoints(cfg: EngineConfig) -> None:
    c = cfg.checkpoint
    for flag, directory in (("--save", c.save), ("--save-hf", c.save_hf)):
        if directory is not None:
            check_can_make_dir(Path(directory), flag)
    if c.load is not None and c.load != c.save:  # --load X --save X is vime's resume-if-there idiom
        load = Path(c.load)
        fix = "give the --save directory of an earlier run, or drop --load to start from --hf-checkpoint"
        if not load.is_dir():
            raise PreflightError(f"--load {c.load}: {'a file' if load.exists() else 'no such directory'}; {fix}")
        if not any(ckpt.candidates(load, content=False)):
            raise PreflightError(f"--load {c.load}: holds no checkpoint (rollout_NNNNNNN/ with a manifest.json); {fix}")
    root = c.load or c.save
    if root is None:
        return
    found = _latest_checkpoint(root)
    if found is not None:
        flag = "--load" if c.load else "--save"
        _check_same_model(found, root, flag, cfg.model.hf_checkpoint)
        _check_expert_optimizer_split(found, root, flag, cfg)


def check_can_make_dir(directory: Path, flag: str, holds: str = "the checkpoints") -> None:
    """`directory` is one, or can be made: no file stands at it or at a folder above it (the run would fail at its
    first save, minutes in, with NotADirectoryError). `holds`: what the directory is for, in the fix."""
    fix = f"give a directory for {holds}"
    if directory.exists() and not directory.is_dir():
        raise PreflightError(f"{flag} {directory}: a file, not a directory; {fix}")
    blocking = next((p for p in directory.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise PreflightError(f"{flag} {directory}: {blocking} is a file, so no directory can be made under it; {fix}")


def _latest_checkpoint(root: str) -> ckpt.CheckpointRef | None:
    """The checkpoint LATEST names, or None where there is none or it is invalid: the resume's own business (it
    skips invalid checkpoints with a warning)."""
    pointer = Path(root) / ckpt.LATEST
    if not pointer.is_file():
        return None
    try:
        return ckpt.validate(Path(root) / pointer.read_text().strip(), content=False)
    except (ckpt.CheckpointError, OSError, UnicodeDecodeError):
        return None


def _check_expert_optimizer_split(found: ckpt.CheckpointRef, root: str, flag: str, cfg: EngineConfig) -> None:
    """A Megatron checkpoint resumes at other tensor- and pipeline-parallel sizes (torch_dist reshards them), but
    not across expert parallelism's edge: at --expert-model-parallel-size > 1 megatron-core keeps the experts'
    optimizer state in an optimizer of their own beside the dense parameters' (a chained optimizer), at 1 in one,
    and loading the one layout into the other failed deep in torch_dist with a KeyError."""
    if cfg.train.train_backend != "megatron":
        return
    try:
        saved = found.driver_state().get("config", {})
    except (ckpt.CheckpointError, OSError, ValueError):
        return
    if saved.get("train_backend") != "megatron":
        return
    was = int(saved.get("megatron.expert-model-parallel-size") or 1)
    now = int(cfg.megatron.get("expert-model-parallel-size") or 1)
    if (was > 1) != (now > 1):
        raise PreflightError(
            f"{flag} {root}: {found.path.name} was saved by Megatron at --expert-model-parallel-size {was} and this "
            f"run asks for {now}: megatron-core keeps the experts' optimizer state apart from the other parameters' "
            "only where experts are parallel (above 1), so the saved optimizer state cannot load; resume at "
            f"--expert-model-parallel-size {was} (tensor and pipeline sizes may change: torch_dist reshards them), "
            "or start afresh with another --save directory")


def _check_same_model(found: ckpt.CheckpointRef, root: str, flag: str, model_dir: str) -> None:
    """The checkpoint must hold weights of the --hf-checkpoint model (names and shapes from the safetensors
    headers; nothing else is read). Backends that do not save `model.safetensors` check their own files."""
    if CHECKPOINT_WEIGHTS not in found.manifest.files:
        return
    saved = _tensor_shapes([found.path / CHECKPOINT_WEIGHTS])
    model = _tensor_shapes(sorted(Path(model_dir).glob("*.safetensors")))
    if not saved or not model:
        return
    common = sorted(saved.keys() & model.keys())
    differ = [n for n in common if saved[n] != model[n]]
    if differ or not common:
        example = (f"{differ[0]} is {saved[differ[0]]} there, {model[differ[0]]} in the model" if differ
                   else f"no tensor names in common, e.g. {min(saved)} there")
        raise PreflightError(
            f"{flag} {root}: {found.path.name} holds the weights of another model than --hf-checkpoint {model_dir} "
            f"({example}); resume with the model it was trained from, or start afresh with another --save directory"
        )


def _tensor_shapes(files: list[Path]) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for file in files:
        try:
            shapes.update({name: list(spec.get("shape", [])) for name, spec in safetensors_header(file).items()})
        except (DamagedSafetensors, OSError):
            return {}  # unreadable: the loader reports it with its own error
    return shapes


def _check_dataset(cfg: EngineConfig, dataset: _Dataset, tokenizer: Any, context: int | None) -> None:
    """Every row (read again: `check_inputs` read them without a tokenizer) renders to a prompt, has a label the
    reward can grade and, within --rollout-max-prompt-len (longer ones are dropped at load, as in slime), fits the
    model's context."""
    flag, path, keys, rm_type, response_len = dataset
    rows = _read_rows(dataset)
    try:
        lengths = prompt_lengths(path, rows, tokenizer, cfg.data.apply_chat_template)
        kept = short_enough(path, rows, lengths, cfg.data.rollout_max_prompt_len)
    except DatasetError as exc:
        raise PreflightError(f"{flag}: {exc}") from None
    empty = [i for i in kept if lengths[i] == 0]
    if empty:  # vLLM refuses an empty prompt
        raise PreflightError(f"{flag}: {path}, row {rows[empty[0]].row}: the prompt is no tokens once tokenized; "
                             "fix the row, or check the --hf-checkpoint tokenizer")
    if rm_type is not None:
        for row, record in (rows[i] for i in kept):
            problem = label_problem(rm_type, record.label)
            if problem:
                raise PreflightError(
                    f"{flag}: {path}, row {row}, key {keys[1]!r}: the label {record.label!r} {problem}; fix the "
                    "row, or choose the reward that fits the data (--rm-type / --eval-rm-type / --custom-rm-path)"
                )
    if context is None:
        return
    # vLLM refuses a prompt that fills the context; one that leaves less than the response budget is generated
    # and its response stops at the context (as a truncated sample), which the user may mean (or want dropped).
    source = "--vllm-max-model-len" if cfg.rollout.vllm_max_model_len else "the model's max_position_embeddings"
    room = context - response_len
    drop_hint = f"drop such prompts with {MAX_PROMPT_FLAG} {room if room > 0 else context - 1}"
    too_long = [i for i in kept if lengths[i] >= context]
    if too_long:
        first = rows[too_long[0]].row
        more = f" (and {len(too_long) - 1} more rows)" if len(too_long) > 1 else ""
        raise PreflightError(
            f"{flag}: {path}, row {first}{more}: the prompt is {lengths[too_long[0]]} tokens, which fills the "
            f"model's context ({source} {context}) and leaves no room for a response; {drop_hint}, or shorten them"
        )
    cut_short = sum(lengths[i] > room for i in kept)
    if cut_short:
        log.warning("%s: %d of %d prompts leave less than the response budget of %d tokens within %s %d, so their "
                    "responses stop early; %s", path, cut_short, len(kept), response_len, source, context, drop_hint)
