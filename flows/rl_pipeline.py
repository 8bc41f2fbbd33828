"""rl-pipeline: the whole RL post-training run as one DAG.

    check_image ─> stage_model ‖ stage_data ─> convert_checkpoint ─> train_chunk × N ─> evaluate ─> publish

Each train_chunk is cached by (input checkpoint, config, rollout range) in the storage root, so re-running
the flow with the same parameters after a crash, a preemption or a cancel trains only what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from flows.deploy import refuse_endless_reruns
from flows.params import (
    EngineSettings, EvaluationSettings, ImageCheck, ModelSource, StorageTarget, TrainData, TrainingPlan,
)
from tasks.evaluate import evaluate
from tasks.images import ImageInfo
from tasks.pipeline_prepare import TrainableModel, check_image, convert_checkpoint, stage_data, stage_model
from tasks.publish import PublishOutcome, publish
from tasks.result_store import results_block
from tasks.engine_job.layout import DatasetRef, EngineJob, RunLayout, bind_work_dir, make_layout
from tasks.staging import StagedAsset
from tasks.train_chunk import train_chunk


def engine_job(engine: EngineSettings, training: TrainingPlan, evaluation: EvaluationSettings,
               trainable: TrainableModel, data: TrainData, train_asset: StagedAsset,
               eval_assets: list[StagedAsset], ray_address: str | None) -> EngineJob:
    """The parameters and staged assets as the engine job every stage shares."""
    eval_flags = {"n-samples-per-eval-prompt": evaluation.n_samples, "eval-input-key": evaluation.input_key,
                  "eval-label-key": evaluation.label_key, "eval-rm-type": evaluation.rm_type,
                  "eval-max-response-len": evaluation.max_response_len,
                  "eval-temperature": evaluation.temperature}
    return EngineJob(
        flags={**engine.flags, **{k: v for k, v in eval_flags.items() if v is not None}},
        num_rollouts=training.num_rollouts, model_uri=trainable.staged.uri,
        model_manifest_hash=trainable.staged.manifest_hash,
        train_data=DatasetRef("train", train_asset.uri, train_asset.manifest_hash, data.file),
        eval_data=[DatasetRef(d.name, a.uri, a.manifest_hash, d.file)
                   for d, a in zip(evaluation.datasets, eval_assets)],
        ray_address=ray_address,
        torch_dist_uri=trainable.uri if trainable.converted else None,
        torch_dist_manifest_hash=trainable.manifest_hash if trainable.converted else None,
    )


def chunk_ranges(num_rollouts: int, per_chunk: int) -> list[tuple[int, int]]:
    """(start, count) of each chunk: consecutive, covering 0 … num_rollouts-1, the last one possibly shorter."""
    return [(s, min(per_chunk, num_rollouts - s)) for s in range(0, num_rollouts, per_chunk)]


@dataclass
class PreparedRun:
    """What the stages before training produce, shared by every flow that trains."""

    root: str
    image_info: ImageInfo | None
    trainable: TrainableModel
    train_asset: StagedAsset
    eval_assets: list[StagedAsset]
    job: EngineJob


def prepare_run(model: ModelSource, data: TrainData, engine: EngineSettings, training: TrainingPlan,
                evaluation: EvaluationSettings, storage: StorageTarget, image: ImageCheck | None,
                ray_address: str | None) -> PreparedRun:
    """check_image → stage_model ‖ stage_data → convert_checkpoint, and the engine job they define."""
    root = storage.resolved_root()
    image_info = check_image(image.reference, image.requirements) if image else None
    model_asset = stage_model.submit(model.source, root)
    train_future = stage_data.submit(data.source, root)
    eval_futures = [stage_data.submit(d.source, root) for d in evaluation.datasets]
    # .result() raises the staging task's own error: a task handed a failed future would not run, and the
    # flow would go on with None in its place.
    trainable = convert_checkpoint(model_asset.result(), engine.flags.get("train-backend", "torch"), root,
                                   training.train_backend_conversion,
                                   engine.flags.get("megatron-to-hf-mode", "raw"))
    train_asset, eval_assets = train_future.result(), [f.result() for f in eval_futures]
    job = engine_job(engine, training, evaluation, trainable, data, train_asset, eval_assets, ray_address)
    return PreparedRun(root, image_info, trainable, train_asset, eval_assets, job)


def publish_run(run: PreparedRun, layout: RunLayout, storage: StorageTarget, chunks: list, final_eval: Any,
                parameters: dict[str, Any]) -> PublishOutcome:
    """publish, with the lineage every flow records."""
    return publish(
        run.job, layout, storage.publish_prefix, chunks, final_eval, run.trainable.staged,
        [run.train_asset, *run.eval_assets], run.image_info.model_dump() if run.image_info else None,
        {**parameters, "storage": {**storage.model_dump(), "root": run.root}},
    )


@flow(name="rl-pipeline", log_prints=True)
def rl_pipeline(
    model: ModelSource = ModelSource(),
    data: TrainData = TrainData(),
    engine: EngineSettings = EngineSettings(),
    training: TrainingPlan = TrainingPlan(),
    evaluation: EvaluationSettings = EvaluationSettings(),
    storage: StorageTarget = StorageTarget(),
    ray_address: str | None = None,
    image: ImageCheck | None = None,
) -> PublishOutcome:
    """Stage, convert, train in resumable chunks, evaluate and publish one RL post-training run."""
    refuse_endless_reruns(flow_run.run_count)
    run = prepare_run(model, data, engine, training, evaluation, storage, image, ray_address)
    layout = make_layout(run.root, storage.run_name or run.job.identity_hash[:12])
    bind_work_dir(layout)
    results = results_block(run.root)

    chunk = train_chunk.with_options(retries=training.infrastructure_retries, result_storage=results)
    chunks, previous = [], None
    for start, count in chunk_ranges(training.num_rollouts, training.rollouts_per_chunk):
        previous = chunk(run.job, layout, start, count, previous)
        chunks.append(previous)

    final_eval = evaluate.with_options(result_storage=results)(run.job, layout, previous)
    return publish_run(run, layout, storage, chunks, final_eval, {
        "model": model.model_dump(), "data": data.model_dump(), "engine": engine.model_dump(),
        "training": training.model_dump(), "evaluation": evaluation.model_dump(), "ray_address": ray_address,
    })

if __name__ == "__main__":
    import sys

    from flows.params import load_params

    print(rl_pipeline(**load_params(sys.argv[1] if len(sys.argv) > 1 else None).as_flow_kwargs()))
