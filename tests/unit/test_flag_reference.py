"""`vimeflow train --help` lists every engine flag, generated from the config's schema."""

from __future__ import annotations

from typer.testing import CliRunner

from flows.cli import app
from vime_engine.config import MEGATRON_FLAGS, SECTIONS
from vime_engine.config.reference import kind_of, section_docs


def test_train_help_lists_every_flag_with_its_default_and_help():
    shown = CliRunner().invoke(app, ["train", "--help"])
    assert shown.exit_code == 0
    lines = shown.output.splitlines()
    batch = next(line for line in lines if line.strip().startswith("--rollout-batch-size "))
    assert "INT" in batch and "default 8" in batch and "prompts per rollout" in batch
    flags = {line.split()[0] for line in lines if line.startswith("  --")}
    fields = {"--" + name.replace("_", "-") for model in SECTIONS.values() for name in model.model_fields}
    assert fields | {f"--{name}" for name in MEGATRON_FLAGS} <= flags


def test_every_field_has_a_line_of_help():
    undocumented = [doc.flag for section, docs in section_docs().items() if section != "megatron"
                    for doc in docs if not doc.help]
    assert not undocumented


def test_value_words():
    fields = {name: info.annotation for model in SECTIONS.values() for name, info in model.model_fields.items()}
    assert kind_of(fields["use_kl_loss"]) == ""  # a bare switch
    assert kind_of(fields["vllm_enforce_eager"]) == "true|false|auto"
    assert kind_of(fields["vllm_max_num_batched_tokens"]) == "INT|auto"
    assert kind_of(fields["eval_prompt_data"]) == "TEXT ..."
    assert kind_of(fields["lr_decay_style"]) == "constant|linear|cosine"
    assert kind_of(fields["eps_clip_high"]) == "FLOAT"
