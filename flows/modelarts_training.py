"""modelarts-training: the rl-pipeline DAG with each training chunk run as a Huawei Cloud ModelArts job.

    check_image ─> stage_model ‖ stage_data ─> convert_checkpoint ─> submit_modelarts × N ─> evaluate
                                                                                        ─> publish

The storage root is on OBS: the jobs fetch the staged model and data from it and commit their checkpoints to it.
A job ModelArts loses (Abnormal / Lost / Unknown) is retried as a new job that resumes from the newest committed
checkpoint; a terminated job cancels the run; cancelling the run terminates the job. Evaluation and publishing
run where the flow runs, as in rl-pipeline, in the same local directory (`modelarts.work_dir`) as the jobs.
"""

from __future__ import annotations

from prefect import flow
from prefect.states import State
from pydantic import BaseModel, ConfigDict, Field

from flows.params import (
    EngineSettings, EvaluationSettings, ImageCheck, ModelSource, StorageTarget, TrainData, TrainingPlan,
)
from flows.rl_pipeline import chunk_ranges, engine_job
from tasks.evaluate import evaluate
from tasks.pipeline_prepare import check_image, convert_checkpoint, stage_data, stage_model
from tasks.publish import PublishOutcome, publish
from tasks.result_store import results_block
from tasks.run_layout import RunLayout
from tasks.submit_modelarts import ModelArtsSettings, submit_modelarts


class ObsStorageTarget(StorageTarget):
    """The run's storage root, which ModelArts jobs must reach: obs://bucket/prefix."""

    model_config = ConfigDict(extra="forbid")
    root: str = Field(description="obs://bucket/prefix", pattern=r"^obs://[^/]+(/.*)?$")


class ModelArtsParams(BaseModel):
    """All parameters of the flow (what a --config YAML for it holds)."""

    model_config = ConfigDict(extra="forbid")
    modelarts: ModelArtsSettings
    storage: ObsStorageTarget
    model: ModelSource = Field(default_factory=ModelSource)
    data: TrainData = Field(default_factory=TrainData)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    training: TrainingPlan = Field(default_factory=TrainingPlan)
    evaluation: EvaluationSettings = Field(default_factory=EvaluationSettings)
    image: ImageCheck | None = None


@flow(name="modelarts-training", log_prints=True)
def modelarts_training(
    modelarts: ModelArtsSettings,
    storage: ObsStorageTarget,
    model: ModelSource = ModelSource(),
    data: TrainData = TrainData(),
    engine: EngineSettings = EngineSettings(),
    training: TrainingPlan = TrainingPlan(),
    evaluation: EvaluationSettings = EvaluationSettings(),
    image: ImageCheck | None = None,
) -> PublishOutcome | State:
    """Stage, convert, train chunk by chunk on ModelArts, evaluate and publish one RL post-training run."""
    root = storage.resolved_root()
    image_info = check_image(image.reference, image.requirements) if image else None

    model_asset = stage_model.submit(model.source, root)
    train_asset = stage_data.submit(data.source, root)
    eval_assets = [stage_data.submit(d.source, root) for d in evaluation.datasets]
    trainable = convert_checkpoint(model_asset, engine.flags.get("train-backend", "torch"), root)

    job = engine_job(engine, training, evaluation, trainable.uri, trainable.manifest_hash, data,
                     train_asset.result(), [a.result() for a in eval_assets], ray_address=None)
    run_name = storage.run_name or job.identity_hash[:12]
    layout = RunLayout(root, run_name, f"{modelarts.work_dir.rstrip('/')}/{run_name}")  # same path in the jobs
    results = results_block(root)

    chunk = submit_modelarts.with_options(retries=training.infrastructure_retries, result_storage=results)
    chunks, previous = [], None
    for start, count in chunk_ranges(training.num_rollouts, training.rollouts_per_chunk):
        state = chunk(job, layout, start, count, previous, modelarts, return_state=True)
        if state.is_cancelled():  # the job was terminated on ModelArts: the run ends Cancelled too
            return state
        previous = state.result()
        chunks.append(previous)

    final_eval = evaluate.with_options(result_storage=results)(job, layout, previous)
    return publish(
        job, layout, storage.publish_prefix, chunks, final_eval, trainable.staged,
        [train_asset.result(), *(a.result() for a in eval_assets)],
        image_info.model_dump() if image_info else None,
        {"model": model.model_dump(), "data": data.model_dump(), "engine": engine.model_dump(),
         "training": training.model_dump(), "evaluation": evaluation.model_dump(),
         "storage": {**storage.model_dump(), "root": root},
         "modelarts": modelarts.model_dump(exclude={"env"})},
    )


if __name__ == "__main__":
    import sys
    from pathlib import Path

    import yaml

    params = ModelArtsParams.model_validate(yaml.safe_load(Path(sys.argv[1]).read_text()))
    print(modelarts_training(**{name: getattr(params, name) for name in type(params).model_fields}))
