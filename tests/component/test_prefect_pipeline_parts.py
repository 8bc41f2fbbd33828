"""Pipeline parts without the engine's heavy path: parameters, chunk ranges, exit classification through a
real child process, Prefect's retry decision on it, and the regression diff."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.params import PipelineParams
from flows.rl_pipeline import chunk_ranges
from tasks.engine_job.messages import TrainJob
from tasks.engine_job.process import (
    EngineCodeFailure, EngineConfigFailure, InfrastructureFailure, is_infrastructure_failure, run_engine_job,
)
from tasks.regression import Band, Baseline, compare, render_diff


def test_chunk_ranges_cover_the_run_once():
    assert chunk_ranges(4, 2) == [(0, 2), (2, 2)]
    assert chunk_ranges(5, 2) == [(0, 2), (2, 2), (4, 1)]
    assert chunk_ranges(3, 8) == [(0, 3)]


def test_parameters_reject_pipeline_managed_and_invalid_engine_flags():
    with pytest.raises(ValueError, match="--save are set by the pipeline"):
        PipelineParams.model_validate({"engine": {"flags": {"save": "/x"}}})
    with pytest.raises(ValueError, match="did you mean --rollout-batch-size"):
        PipelineParams.model_validate({"engine": {"flags": {"rollout-batch-sise": 4}}})
    assert PipelineParams().model.source == "builtin://smollm2-135m-instruct"


def test_engine_config_error_comes_back_with_the_engines_message(tmp_path):
    flags = {"hf-checkpoint": "m", "prompt-data": "d", "save": str(tmp_path), "n-samples-per-prompt": 1}
    with pytest.raises(EngineConfigFailure, match="set --n-samples-per-prompt to 2 or more"):
        run_engine_job(TrainJob(flags=flags, start=0, count=1), tmp_path / "job")


def test_engine_code_error_comes_back_with_its_traceback(tmp_path):
    bad = TrainJob.model_construct(flags={}, start="first", count=1)  # a job file no caller writes
    named = r"(?s)Traceback.*MessageError: .*job\.json does not hold .*train\.start: Input should be a valid integer"
    with pytest.raises(EngineCodeFailure, match=named), pytest.warns(UserWarning, match="serializ"):
        run_engine_job(bad, tmp_path / "job")


def test_prefect_retries_infrastructure_failures_only(prefect_harness):
    from prefect import flow, task

    attempts = {"infra": 0, "config": 0}

    @task(retries=3, retry_delay_seconds=0, retry_condition_fn=is_infrastructure_failure)
    def flaky(kind: str) -> str:
        attempts[kind] += 1
        if kind == "infra" and attempts[kind] < 3:
            raise InfrastructureFailure("engine exit 75: preempted after rollout 1")
        if kind == "config":
            raise EngineConfigFailure("--lr -1: must be > 0")
        return "done"

    @flow
    def both() -> tuple:
        return flaky("infra"), flaky("config", return_state=True)

    value, config_state = both()
    assert value == "done" and attempts["infra"] == 3
    assert config_state.is_failed() and attempts["config"] == 1


def test_regression_diff_names_what_left_its_band():
    baseline = Baseline(bands=[Band(metric="reward_last", baseline=0.5, below=0.1),
                               Band(metric="logprob_diff_last", baseline=0.0, above=1e-5),
                               Band(metric="eval/aime final", baseline=0.2, below=0.1, above=0.1)])
    results = compare({"reward_last": 0.3, "logprob_diff_last": 2e-7}, baseline)
    assert [r.passed for r in results] == [False, True, False]
    diff = render_diff(results)
    assert diff.startswith("**2 of 3 metric(s) outside their band**")
    assert "| ❌ | reward_last | 0.3 | 0.5 | [0.4, 0.5] | -0.1 under |" in diff
    assert "| ❌ | eval/aime final | — | 0.2 | [0.1, 0.3] | missing |" in diff


def test_work_dir_of_a_run_whose_storage_was_removed_starts_afresh(tmp_path, monkeypatch):
    import shutil

    from tasks.engine_job.layout import bind_work_dir, make_layout

    monkeypatch.setenv("VIMEFLOW_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "runs-root"
    root.mkdir()
    layout = make_layout(root.as_uri(), "demo")
    bind_work_dir(layout)
    checkpoint = tmp_path / "cache" / "work" / layout.work_dir.rsplit("/", 1)[1] / "checkpoints" / "rollout_0000003"
    checkpoint.mkdir(parents=True)

    bind_work_dir(layout)  # a re-run of the same run keeps its in-chunk checkpoints
    assert checkpoint.is_dir()

    shutil.rmtree(root)  # the user starts over
    root.mkdir()
    bind_work_dir(layout)
    assert not checkpoint.exists()


def test_a_flow_run_that_keeps_crashing_is_not_rerun_forever():
    from flows.deploy import CRASH_RERUN_LIMIT, refuse_endless_reruns

    for run_count in range(1, CRASH_RERUN_LIMIT + 2):  # the first start and every allowed re-run
        refuse_endless_reruns(run_count)
    with pytest.raises(RuntimeError, match=f"started {CRASH_RERUN_LIMIT + 2} times"):
        refuse_endless_reruns(CRASH_RERUN_LIMIT + 2)


def test_a_chunk_on_an_object_store_is_refused_while_another_run_holds_the_runs_lease(prefect_harness, moto_endpoint,
                                                                                      make_bucket, monkeypatch,
                                                                                      tmp_path):
    """train_chunk takes the run's lease before it fetches or starts anything (tasks/storage/lease.py is tested on
    its own in tests/component/test_storage_lease.py)."""
    from prefect import flow

    from tasks.engine_job.layout import DatasetRef, EngineJob, make_layout
    from tasks.storage import join_key, open_storage
    from tasks.storage.lease import Holder, LeaseHeld, StorageLease
    from tasks.train_chunk import CHUNK_LEASE, train_chunk

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("S3_ADDRESSING_STYLE", "path")
    monkeypatch.setenv("VIMEFLOW_CACHE", str(tmp_path / "cache"))
    layout = make_layout(f"s3://{make_bucket()}", "busy")
    job = EngineJob(flags={"rollout-batch-size": 4}, num_rollouts=2, model_uri=f"{layout.storage_root}/models/m",
                    model_manifest_hash="a" * 64, train_data=DatasetRef("train", f"{layout.storage_root}/d", "b" * 64,
                                                                        None))

    @flow
    def one_chunk() -> None:
        train_chunk(job, layout, 0, 2, None)

    other = StorageLease(open_storage(layout.storage_root), join_key(layout.run_prefix, CHUNK_LEASE),
                         Holder("flow run 'first'", "node-a", 4242), lease_seconds=2.0, renew_every=0.3, grace=0.3)
    with other:
        state = one_chunk(return_state=True)
    assert state.is_failed()
    with pytest.raises(LeaseHeld, match=r"runs/busy/chunk-lease is in use by another run \(flow run 'first', on host "
                                        r"node-a, pid 4242, lease until .*\): wait for it to end, or give this run "
                                        r"another storage.run_name than 'busy'"):
        state.result()
    assert not Path(layout.work_dir, "assets").exists()  # nothing fetched, no engine started
