"""The pipeline's parameters as pydantic models: the Prefect UI renders them as a form, the server rejects
values outside their schema, and the flow validates the engine flags against EngineConfig before any work.

The defaults are the embedded default run (`vimeflow run` without --config): built-in SmolLM2-135M-Instruct
on built-in one-digit arithmetic problems, evaluated on the held-out arithmetic problems and the built-in
AIME-shaped set, with the engine flags of flows/configs/demo-engine.yaml (shipped as package data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flows.configs import config_file
from tasks.images import ImageRequirements
from tasks.storage import root_problem
from vime_engine.config import ConfigError

DEMO_ENGINE_YAML = "demo-engine.yaml"

# Set by the pipeline from the other parameters; an engine flag of the same name would be ambiguous.
PIPELINE_FLAGS = {"hf-checkpoint", "prompt-data", "num-rollout", "save", "load", "output-dir", "save-hf",
                  "eval-prompt-data", "ray-address", "start-rollout-id"}

# Checkpoint cadence of the pipeline's default run: an in-chunk checkpoint halfway through each chunk of 6 (every 3
# rollouts), 2 kept on disk. SmolLM2-135M's checkpoint (weights and Adam's moments, fp32) is 1.6 GB, about 4 s a save
# on the 2-core machine, so the demo's 12 rollouts save 4 times, not 6.
PIPELINE_CHECKPOINT_FLAGS: dict[str, Any] = {"save-interval": 3, "keep-last": 2}


def _norm(key: str) -> str:
    return key.replace("_", "-")


def demo_engine_values() -> dict[str, Any]:
    """flows/configs/demo-engine.yaml as flat values (flag spelling); a missing file is an error naming it."""
    from vime_engine.config import load_yaml

    return {_norm(k): v for k, v in load_yaml(config_file(DEMO_ENGINE_YAML)).items()}


# The forms of a source and a storage root, for the UI's form (the JSON schema); the validators below check the
# same and say what is wrong in words.
SOURCE_PATTERN = {"pattern": r"^(hf|file|s3|obs|builtin)://.+|^/.+"}
ROOT_PATTERN = {"pattern": r"^(file|s3|obs)://.+"}


class ParamsError(ConfigError):
    """Pipeline parameters the schema refuses, each named by its field and value (exit 2)."""


def checked_source(source: str, kind: str) -> str:
    """`source` if the pipeline can stage it as a `kind` ("model" or "dataset"); else ValueError naming the schemes,
    the missing bucket or the built-in names there are."""
    from tasks.staging import parse_source

    spec = parse_source(source, kind)
    if spec.scheme in ("s3", "obs") and (problem := root_problem(source)):
        raise ValueError(problem)
    if spec.scheme == "builtin":
        from vime_engine.assets import check_builtin

        check_builtin(source, kind)
    return source


class ModelSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(default_factory=lambda: demo_engine_values()["hf-checkpoint"],
                        description="hf://ORG/NAME[@REV], file:///dir, s3://…, obs://… or builtin://NAME",
                        json_schema_extra=SOURCE_PATTERN)

    @field_validator("source")
    @classmethod
    def _stageable(cls, source: str) -> str:
        return checked_source(source, "model")


class TrainData(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(default_factory=lambda: demo_engine_values()["prompt-data"],
                        description="prompt dataset (same schemes as the model)", json_schema_extra=SOURCE_PATTERN)
    file: str | None = Field(None, description="the .jsonl/.parquet inside the staged tree (default: its only one)")

    @field_validator("source")
    @classmethod
    def _stageable(cls, source: str) -> str:
        return checked_source(source, "dataset")


class EvalDataset(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="metrics are eval/NAME and eval/NAME-pass@k")
    source: str = Field(json_schema_extra=SOURCE_PATTERN)
    file: str | None = None

    @field_validator("source")
    @classmethod
    def _stageable(cls, source: str) -> str:
        return checked_source(source, "dataset")


def eval_sets_of(values: dict[str, Any]) -> list[EvalDataset]:
    """The eval sets of engine flags (`eval-prompt-data: [name, source, …]`)."""
    pairs = values.get("eval-prompt-data") or []
    return [EvalDataset(name=n, source=src) for n, src in zip(pairs[0::2], pairs[1::2])]


def _default_eval_sets() -> list[EvalDataset]:
    """demo-engine.yaml's eval sets: the held-out arithmetic problems (where learning shows) and the AIME-shaped
    set (which a 135M model scores near 0 on)."""
    return eval_sets_of(demo_engine_values())


class EvaluationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    datasets: list[EvalDataset] = Field(default_factory=lambda: _default_eval_sets())
    n_samples: int = Field(4, ge=1, le=1024, description="samples per problem (avg@n, pass@k for k ≤ n)")
    input_key: str | None = Field(None, description="default: the training data's key")
    label_key: str | None = None
    rm_type: str | None = Field(None, description="default: the training reward (--rm-type)")
    max_response_len: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, gt=0)


class EngineSettings(BaseModel):
    """vime flags (flat names, e.g. `rollout-batch-size: 16`) for everything the pipeline does not set."""

    model_config = ConfigDict(extra="forbid")
    flags: dict[str, Any] = Field(default_factory=lambda: engine_flags_of(demo_engine_values()))

    @field_validator("flags")
    @classmethod
    def _check_flags(cls, flags: dict[str, Any]) -> dict[str, Any]:
        from vime_engine.config import ConfigError, from_flat

        flags = {_norm(k): v for k, v in flags.items()}
        managed = sorted(PIPELINE_FLAGS & set(flags))
        if managed:
            raise ValueError(f"{', '.join('--' + f for f in managed)} are set by the pipeline from its other "
                             "parameters (model, data, training, evaluation, storage, ray_address)")
        try:  # validate everything else now, before staging anything
            from_flat({**flags, "hf-checkpoint": "<model>", "prompt-data": "<data>", "save": "<save>"})
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return flags


def engine_flags_of(values: dict[str, Any]) -> dict[str, Any]:
    """The flags of an engine config the pipeline passes on: all but those it sets itself, with its checkpoint
    cadence unless the config has one."""
    return {**PIPELINE_CHECKPOINT_FLAGS, **{k: v for k, v in values.items() if k not in PIPELINE_FLAGS}}


class TrainingPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_rollouts: int = Field(
        default_factory=lambda: int(demo_engine_values()["num-rollout"]), ge=1)
    # 6: the demo's 12 rollouts in 2 chunks; each chunk is an engine process that pays about 20 s of start-up
    # (Ray, the trainer, vLLM) and 5 s to load the checkpoint it resumes from.
    rollouts_per_chunk: int = Field(6, ge=1, description="rollouts per train_chunk task (a resumable unit)")
    infrastructure_retries: int = Field(3, ge=0, le=20, description="retries of a chunk after preemption, "
                                        "a dead Ray actor or a storage 5xx; other errors fail at once")
    train_backend_conversion: bool = Field(True, description="Megatron: convert the HF model to torch_dist once "
                                           "(verified by a round trip) and start from it; off: Megatron reads the "
                                           "HF weights itself. The torch backend trains HF weights either way")


class StorageTarget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str | None = Field(None, description="file:///…, s3://bucket/prefix or obs://bucket/prefix; "
                             "default: file://<working directory>/vimeflow-runs", json_schema_extra=ROOT_PATTERN)
    run_name: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$",
                                 description="default: derived from the model, data and engine config")
    publish_prefix: str = Field("published", pattern=r"^[A-Za-z0-9._/-]+$",
                                description="where publish writes under the run's prefix")

    @field_validator("root")
    @classmethod
    def _a_storage_root(cls, root: str | None) -> str | None:
        if root is not None and (problem := root_problem(root) or (None if "://" in root else
                                                                    "a URI: file:///DIR for a directory")):
            raise ValueError(problem)
        return root

    def resolved_root(self) -> str:
        return self.root or (Path.cwd() / "vimeflow-runs").resolve().as_uri()


class ImageCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reference: str = Field(description="registry/repo:tag or @sha256:…")
    requirements: ImageRequirements = Field(default_factory=ImageRequirements,
                                            description="architecture (arm64 for Ascend), label checks")


class PipelineParams(BaseModel):
    """All parameters together: what `vimeflow run --config FILE` reads (every section optional)."""

    model_config = ConfigDict(extra="forbid")
    model: ModelSource = Field(default_factory=ModelSource)
    data: TrainData = Field(default_factory=TrainData)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    training: TrainingPlan = Field(default_factory=TrainingPlan)
    evaluation: EvaluationSettings = Field(default_factory=EvaluationSettings)
    storage: StorageTarget = Field(default_factory=StorageTarget)
    ray_address: str | None = None
    image: ImageCheck | None = None

    @model_validator(mode="after")
    def _chunks_fit(self) -> PipelineParams:
        if self.training.rollouts_per_chunk > self.training.num_rollouts:
            self.training.rollouts_per_chunk = self.training.num_rollouts
        return self

    def as_flow_kwargs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in type(self).model_fields}


def load_params(path: str | Path | None) -> PipelineParams:
    """PipelineParams from a YAML file: pipeline parameters, or an engine config of vime flags (what `vimeflow train
    --config` reads, e.g. configs/agent-demo.yaml); the embedded default when None."""
    if path is None:
        return PipelineParams()
    from vime_engine.config import load_yaml

    values = load_yaml(path)
    flags = {_norm(k): v for k, v in values.items()}
    try:
        if "hf-checkpoint" in flags:
            try:
                return params_from_engine_values(flags)
            except ValidationError as exc:  # named by the engine config's key that filled the section
                raise ParamsError(f"{path}: {refusal(exc, ENGINE_KEYS.get(exc.title))}") from None
        return PipelineParams.model_validate(values)
    except ValidationError as exc:
        raise ParamsError(f"{path}: {refusal(exc)}") from None


# The key of an engine config (`params_from_engine_values`) that fills each section with a single source.
ENGINE_KEYS = {"ModelSource": "hf-checkpoint", "TrainData": "prompt-data", "EvalDataset": "eval-prompt-data"}


def refusal(exc: ValidationError, key: str | None = None) -> str:
    """pydantic's errors as one line: each field (or `key`), its value (when it is one) and what is wrong with it."""
    parts = []
    for error in exc.errors():
        field = key or ".".join(str(part) for part in error["loc"])
        value = error.get("input")
        shown = f" {value!r}" if isinstance(value, (str, int, float, bool)) else ""
        reason = error["msg"].removeprefix("Value error, ").removeprefix(f"{value}: ")  # not the value twice
        parts.append(f"{field}{shown}: {reason}")
    return "; ".join(parts)


def params_from_engine_values(values: dict[str, Any]) -> PipelineParams:
    """An engine config as pipeline parameters: its model, training data, eval sets (with their samples per
    prompt) and rollout count fill those sections, its other flags the engine's. Its directories (--save,
    --output-dir, …) are not used: the pipeline keeps the run under its storage root."""
    samples = {"n_samples": values["n-samples-per-eval-prompt"]} if "n-samples-per-eval-prompt" in values else {}
    training = {"num_rollouts": values["num-rollout"]} if "num-rollout" in values else {}
    return PipelineParams(
        model=ModelSource(source=values["hf-checkpoint"]), data=TrainData(source=values["prompt-data"]),
        engine=EngineSettings(flags=engine_flags_of(values)), training=TrainingPlan(**training),
        evaluation=EvaluationSettings(datasets=eval_sets_of(values), **samples),
    )
