"""`vimeflow run --config` takes an engine config (vime flags, as `vimeflow train --config`) as well as pipeline
parameters: the agent demo runs through the pipeline from the same file. Bad parameters are one message naming the
field, its value and the choices, as the engine's are (not pydantic's dump with its regex)."""

from __future__ import annotations

import pytest
import yaml

from flows.configs import config_file
from flows.params import PIPELINE_CHECKPOINT_FLAGS, PIPELINE_FLAGS, PipelineParams, StorageTarget, load_params
from vime_engine.config import ConfigError


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


ROOTS = "supported: file:///DIR, s3://BUCKET[/PREFIX] or obs://BUCKET[/PREFIX]"


@pytest.mark.parametrize(("text", "message"), [
    ("storage:\n  root: ftp://host/runs\n", f"storage.root 'ftp://host/runs': unsupported scheme ftp://; {ROOTS}"),
    ("storage:\n  root: s3://\n", f"storage.root 's3://': no bucket; {ROOTS}"),
    ("storage:\n  root: obs:///runs\n", f"storage.root 'obs:///runs': no bucket; {ROOTS}"),
    ("storage:\n  root: runs\n", f"storage.root 'runs': no scheme; {ROOTS}"),
    ("model:\n  source: builtin://no-such-model\n", "model.source 'builtin://no-such-model': no such built-in model; "
     "the built-in models are builtin://tiny-qwen3"),
    ("data:\n  source: builtin://no-such-set\n", "data.source 'builtin://no-such-set': no such built-in dataset; "
     "the built-in datasets are builtin://arithmetic, "),
    ("evaluation:\n  datasets:\n  - {name: aime, source: builtin://aime}\n",
     "evaluation.datasets.0.source 'builtin://aime': no such built-in dataset"),
    ("data:\n  source: s3:///prompts\n", f"data.source 's3:///prompts': no bucket; {ROOTS}"),
    # an engine config: named by its own key
    ("hf-checkpoint: builtin://no-such-model\nprompt-data: builtin://arithmetic\n",
     "hf-checkpoint 'builtin://no-such-model': no such built-in model"),
], ids=["ftp-root", "s3-root-without-bucket", "obs-root-without-bucket", "root-without-scheme",
        "unknown-builtin-model", "unknown-builtin-dataset", "unknown-builtin-eval-set", "s3-source-without-bucket",
        "engine-config-unknown-builtin-model"])
def test_bad_parameters_are_one_message_naming_the_field_the_value_and_the_choices(tmp_path, text, message):
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:  # exit 2 from `vimeflow run`
        load_params(path)
    assert str(refused.value).startswith(f"{path}: {message}"), str(refused.value)
    assert "pattern" not in str(refused.value) and "validation error" not in str(refused.value)


def test_the_ui_form_keeps_the_schemes_of_sources_and_roots():
    schema = PipelineParams.model_json_schema()["$defs"]
    assert schema["StorageTarget"]["properties"]["root"]["pattern"] == r"^(file|s3|obs)://.+"
    for section in ("ModelSource", "TrainData", "EvalDataset"):
        assert schema[section]["properties"]["source"]["pattern"] == r"^(hf|file|s3|obs|builtin)://.+|^/.+"
    assert StorageTarget(root="s3://bucket/runs").root == "s3://bucket/runs"
