"""`training.train_backend_conversion`: with Megatron, on hands the converted torch_dist checkpoint to the trainer
as its initial weights (--ref-load); off, the trainer reads the staged HF model itself and nothing is converted."""

from __future__ import annotations

import sys

import pytest

from flows.params import EngineSettings, EvaluationSettings, TrainData, TrainingPlan
from flows.rl_pipeline import engine_job
from tasks.pipeline_prepare import TrainableModel, convert_checkpoint
from tasks.staging import StagedAsset
from vime_engine.preflight import PreflightError

MODEL = StagedAsset("model", "file:///runs/models/tiny", "a" * 64, "builtin:tiny-qwen3", "builtin", {}, False)
DATA = StagedAsset("dataset", "file:///runs/data/train", "b" * 64, "builtin:digits", "builtin", {}, False)


def _job(trainable: TrainableModel):
    return engine_job(EngineSettings(), TrainingPlan(), EvaluationSettings(datasets=[]), trainable, TrainData(),
                      DATA, [], None)


def test_megatron_without_conversion_trains_from_the_staged_hf_model():
    trainable = convert_checkpoint.fn(MODEL, "megatron", "file:///runs", convert=False)
    assert (trainable.uri, trainable.backend, trainable.converted) == (MODEL.uri, "megatron", False)
    job = _job(trainable)
    assert job.model_uri == MODEL.uri and job.torch_dist_uri is None and job.torch_dist_manifest_hash is None


def test_a_converted_checkpoint_becomes_the_trainers_initial_weights():
    converted = TrainableModel("file:///runs/models/tiny-megatron", "c" * 64, "megatron", MODEL)
    job = _job(converted)
    assert converted.converted and job.model_uri == MODEL.uri  # vLLM and the tokenizer keep the HF model
    assert (job.torch_dist_uri, job.torch_dist_manifest_hash) == (converted.uri, converted.manifest_hash)


def test_the_torch_backend_never_converts():
    for convert in (True, False):
        trainable = convert_checkpoint.fn(MODEL, "torch", "file:///runs", convert=convert)
        assert not trainable.converted and _job(trainable).torch_dist_uri is None


def test_bridge_mode_without_megatron_bridge_stops_the_convert_stage_before_anything_is_fetched(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.bridge", None)  # absent on 3.11; made so where it is installed
    for convert in (True, False):
        with pytest.raises(PreflightError, match="--megatron-to-hf-mode bridge needs megatron-bridge"):
            convert_checkpoint.fn(MODEL, "megatron", "file:///nowhere", convert=convert, megatron_to_hf_mode="bridge")
