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
from flows.rl_pipeline import chunk_ranges, prepare_run, publish_run
from tasks.evaluate import evaluate
from tasks.publish import PublishOutcome
from tasks.result_store import results_block
from tasks.engine_job.layout import RunLayout
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
    run = prepare_run(model, data, engine, training, evaluation, storage, image, ray_address=None)
    run_name = storage.run_name or run.job.identity_hash[:12]
    layout = RunLayout(run.root, run_name, f"{modelarts.work_dir.rstrip('/')}/{run_name}")  # same path in the jobs
    results = results_block(run.root)

    chunk = submit_modelarts.with_options(retries=training.infrastructure_retries, result_storage=results)
    chunks, previous = [], None
    for start, count in chunk_ranges(training.num_rollouts, training.rollouts_per_chunk):
        state = chunk(run.job, layout, start, count, previous, modelarts, return_state=True)
        if state.is_cancelled():  # the job was terminated on ModelArts: the run ends Cancelled too
            return state
        previous = state.result()
        chunks.append(previous)

    final_eval = evaluate.with_options(result_storage=results)(run.job, layout, previous)
    return publish_run(run, layout, storage, chunks, final_eval, {
        "model": model.model_dump(), "data": data.model_dump(), "engine": engine.model_dump(),
        "training": training.model_dump(), "evaluation": evaluation.model_dump(),
        "modelarts": modelarts.model_dump(exclude={"env"}),
    })

if __name__ == "__main__":
    import sys
    from pathlib import Path

    import yaml

    params = ModelArtsParams.model_validate(yaml.safe_load(Path(sys.argv[1]).read_text()))
    print(modelarts_training(**{name: getattr(params, name) for name in type(params).model_fields}))
