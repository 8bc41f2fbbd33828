"""rl-pipeline with `train-backend: megatron` on the tiny model, in process (one chunk of two rollouts, TP=1, no eval
sets): each consumer gets the artifact it reads. The engine is handed the staged HF model as --hf-checkpoint (vLLM,
tokenizer, HF export) and the converted torch_dist checkpoint as --ref-load (the Megatron trainer's initial weights;
tests/megatron/test_initial_weights.py shows the trainer loads them and not --hf-checkpoint); the report and
lineage name the converted checkpoint, and the published HF export holds the trained weights of the final
checkpoint as the trainer restores them.

Nothing is installed for Megatron on CPU here: the conversion task and the engine's ranks prepare the CPU
themselves (vime_engine/devices/megatron_on_cpu.py), as a user's pipeline does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from flows.params import EvaluationSettings, StorageTarget, load_params
from tasks.engine_job.layout import make_layout
from vime_engine.checkpoint import store as ckpt
from vime_engine.config import from_flat
from vime_engine.train.megatron_hf import is_converted_checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_pipeline_trains_megatron_from_the_converted_checkpoint(prefect_harness, tiny_model, monkeypatch, tmp_path):
    from flows.rl_pipeline import rl_pipeline
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    params = load_params(REPO / "configs" / "pipeline-tiny.yaml")
    root = (tmp_path / "store").as_uri()
    params.engine.flags.update({"train-backend": "megatron"})
    params.training.num_rollouts, params.training.rollouts_per_chunk = 2, 2
    params.evaluation = EvaluationSettings(datasets=[])
    params.storage = StorageTarget(root=root, run_name="megatron-tiny")

    state = rl_pipeline(**params.as_flow_kwargs(), return_state=True)
    assert state.is_completed(), state.message

    [published] = list((tmp_path / "store").glob("runs/*/published"))
    lineage = json.loads((published / "lineage.json").read_text())
    torch_dist = lineage["torch_dist"]
    assert torch_dist["uri"].endswith("-megatron") and len(torch_dist["manifest_sha256"]) == 64
    assert torch_dist["manifest_sha256"] != lineage["model"]["manifest_sha256"]
    assert f"- trained from: `{torch_dist['uri']}`" in (published / "report.md").read_text()

    history = [json.loads(line) for line in (published / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["train/train_rollout_logprob_abs_diff"] for r in history if "rollout/raw_reward" in r]
    assert len(gaps) == 2 and max(gaps) <= 1e-5, gaps  # vLLM ran the trainer's weights after every sync

    work = Path(make_layout(root, "megatron-tiny").work_dir)
    final = ckpt.find_latest(work / "checkpoints")
    assert final.rollout_id == 1
    engine_flags = json.loads((final.path / "driver.json").read_text())["config"]
    hf_dir, ref_load = Path(engine_flags["hf_checkpoint"]), Path(engine_flags["ref_load"])
    assert (hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file()
    assert not is_converted_checkpoint(hf_dir) and is_converted_checkpoint(ref_load)

    # The export is the final checkpoint's weights (restored here as the trainer restores them), trained away
    # from the initial model, with the HF model's config.
    from vime_engine.train.megatron_backend import MegatronTrainBackend

    trainer = MegatronTrainBackend(from_flat(engine_flags))
    trainer.load_state(final.path, final.manifest.files)
    trained = {name: t.clone() for name, t in trainer.named_weights()}
    exported = load_file(published / "hf" / "model.safetensors")
    initial = load_file(tiny_model / "model.safetensors")
    assert set(exported) <= set(trained) and "model.embed_tokens.weight" in exported
    for name, tensor in exported.items():
        assert torch.equal(tensor, trained[name]), name
    assert max((exported[n] - initial[n]).abs().max().item() for n in exported) > 1e-4
    assert (published / "hf" / "config.json").is_file()
