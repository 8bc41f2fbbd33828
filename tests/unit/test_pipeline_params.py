"""`vimeflow run --config` takes an engine config (vime flags, as `vimeflow train --config`) as well as pipeline
parameters: the agent demo runs through the pipeline from the same file."""

from __future__ import annotations

import pytest
import yaml

from flows.configs import config_file
from flows.params import PIPELINE_CHECKPOINT_FLAGS, PIPELINE_FLAGS, load_params


def test_an_engine_config_fills_the_pipelines_sections_and_passes_the_other_flags_on():
    engine = yaml.safe_load(config_file("agent-demo.yaml").read_text())
    params = load_params(config_file("agent-demo.yaml"))
    assert params.model.source == engine["hf-checkpoint"] and params.data.source == engine["prompt-data"]
    assert params.training.num_rollouts == engine["num-rollout"]
    assert [(d.name, d.source) for d in params.evaluation.datasets] == [tuple(engine["eval-prompt-data"])]
    assert params.evaluation.n_samples == engine["n-samples-per-eval-prompt"]
    flags = params.engine.flags
    assert flags["custom-generate-function-path"] == engine["custom-generate-function-path"]
    assert flags["rollout-max-turns"] == engine["rollout-max-turns"]
    assert not PIPELINE_FLAGS & set(flags)  # the run's directories are the pipeline's, under its storage root
    assert {k: flags[k] for k in PIPELINE_CHECKPOINT_FLAGS} == PIPELINE_CHECKPOINT_FLAGS


def test_an_engine_configs_own_checkpoint_cadence_wins_and_snake_case_keys_work(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("hf_checkpoint: builtin://tiny-qwen3\nprompt_data: builtin://arithmetic\nsave_interval: 5\n"
                    "input_key: question\nlabel_key: answer\n")
    params = load_params(path)
    assert params.model.source == "builtin://tiny-qwen3" and params.engine.flags["save-interval"] == 5
    assert params.evaluation.datasets == []


def test_a_bad_flag_in_an_engine_config_is_refused_naming_it(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("hf-checkpoint: builtin://tiny-qwen3\nprompt-data: builtin://arithmetic\nrollout-batch-size: 0\n")
    with pytest.raises(ValueError, match="rollout-batch-size"):
        load_params(path)
