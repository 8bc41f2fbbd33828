"""Bad input, the way a new user makes it: every case is refused before any worker starts, with one message that
names the flag / file / row and the fix (issue 16). The table runs the real config parser, YAML loader and
`preflight` on the built-in tiny model; tests/component/test_cli_bad_input.py runs a few through the CLI."""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vime_engine.assets import resolve_config_assets
from vime_engine.checkpoint import store as ckpt
from vime_engine.config import ConfigError, build_config, from_flat, load_yaml
from vime_engine.data.datasets import read_prompt_rows
from vime_engine.data.prompt_length import load_prompts
from vime_engine.preflight import (
    DamagedSafetensors,
    PreflightError,
    check_inputs,
    check_megatron_mapping,
    check_on_device,
    module_available,
    preflight,
    safetensors_header,
)
from vime_engine.rewards.dapo import dapo_reward

GOOD_ROW = {"prompt": "What is 2 + 3?", "label": "5"}


def jsonl(*rows: object) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


GOOD_DATA = jsonl(GOOD_ROW, {"prompt": "What is 4 + 4?", "label": "8"})


def other_model_checkpoint(root: Path) -> None:
    """A valid checkpoint (manifest, LATEST) whose weights have another model's shapes."""
    staged = ckpt.staging_dir(root, 0)
    save_file({"model.embed_tokens.weight": torch.zeros(10, 8)}, str(staged / "model.safetensors"))
    ckpt.commit(root, staged, 0, {"rollout_id": 0}, None)


def _as_model_type(dest: Path, model: Path, model_type: str) -> None:
    """The tiny model's files, its config claiming another architecture."""
    dest.mkdir()
    for path in model.iterdir():
        if path.is_file():
            (dest / path.name).write_bytes(path.read_bytes())
    config = json.loads((model / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "model_type": model_type}))


def damaged_model(damage: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    """Setup: a copy `m` of the tiny model, then `damage` (or another change) done to it."""
    def setup(tmp: Path, model: Path) -> None:
        (tmp / "m").mkdir()
        for path in model.iterdir():
            if path.is_file():
                (tmp / "m" / path.name).write_bytes(path.read_bytes())
        damage(tmp / "m")
    return setup


def _truncate(path: Path, lost: int) -> None:
    """`path` without its last `lost` bytes, as a download cut short leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - lost])


def _as_shards(model: Path) -> None:
    """The weights as save_pretrained shards them: an index naming two files, the second of them missing."""
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def copy_from_model(*names: str) -> Callable[[Path, Path], None]:
    """Setup: a directory `m` holding only these files of the tiny model."""
    def setup(tmp: Path, model: Path) -> None:
        (tmp / "m").mkdir()
        for name in names:
            (tmp / "m" / name).write_bytes((model / name).read_bytes())
    return setup


@dataclass(frozen=True)
class Case:
    id: str
    flags: dict[str, object] = field(default_factory=dict)  # over the base flags; "{tmp}" / "{model}" filled in
    files: dict[str, str | bytes] = field(default_factory=dict)  # written under tmp before the run
    expect: tuple[str, ...] = ()  # substrings of the message: what is wrong, where, and the fix
    setup: Callable[[Path, Path], None] | None = None
    yaml: str | bytes | None = None  # when set: load_yaml of this text is the case


BASE = {"hf-checkpoint": "{model}", "prompt-data": "{tmp}/data.jsonl"}
DATA = {"data.jsonl": GOOD_DATA}

CASES = [
    # -- flags the engine would ignore, and impossible combinations ---------------------------------------------
    Case("kl-coef-with-grpo", {"kl-coef": 0.1}, DATA,
         ("--kl-coef 0.1", "grpo", "--use-kl-loss --kl-loss-coef 0.1", "reinforce_plus_plus")),
    Case("kl-coef-with-gspo-and-kl-loss", {"kl-coef": 0.1, "advantage-estimator": "gspo", "use-kl-loss": True}, DATA,
         ("--kl-coef 0.1", "gspo", "drop --kl-coef")),
    Case("kl-coef-with-ppo", {"kl-coef": 0.05, "advantage-estimator": "ppo"}, DATA, ("--kl-coef 0.05", "ppo")),
    Case("kl-loss-coef-without-use-kl-loss", {"kl-loss-coef": 0.01}, DATA,
         ("--kl-loss-coef 0.01", "add --use-kl-loss")),
    Case("flag-typo", {"rollout-batchsize": 4}, DATA, ("unknown flag --rollout-batchsize", "--rollout-batch-size")),
    Case("global-batch-does-not-divide", {"global-batch-size": 3}, DATA, ("--global-batch-size 3", "use one of")),
    Case("grpo-one-sample", {"n-samples-per-prompt": 1}, DATA, ("--n-samples-per-prompt", "2 or more")),
    Case("eval-data-not-pairs", {"eval-prompt-data": ["aime"]}, DATA, ("--eval-prompt-data", "NAME PATH")),
    Case("save-interval-without-save", {"save-interval": 2}, DATA, ("--save-interval", "--save DIR")),
    Case("max-prompt-len-zero", {"rollout-max-prompt-len": 0}, DATA, ("--rollout-max-prompt-len", "greater than")),
    Case("response-fills-context", {"vllm-max-model-len": 64, "rollout-max-response-len": 64}, DATA,
         ("--rollout-max-response-len 64", "--vllm-max-model-len 64")),
    Case("eval-response-fills-context", {"vllm-max-model-len": 100, "eval-max-response-len": 120}, DATA,
         ("--eval-max-response-len 120", "no room for the prompt", "--vllm-max-model-len 100", "less than 100")),
    Case("engine-devices-that-do-not-split-the-heads", {"rollout-num-gpus-per-engine": 3, "rollout-num-gpus": 3},
         DATA, ("--rollout-num-gpus-per-engine 3", "4 attention heads", "num_attention_heads", "divisor of 4")),
    Case("multi-turn-context-beyond-vllm-max-model-len", {"vllm-max-model-len": 512, "rollout-max-context-len": 600,
         "custom-generate-function-path": "{tmp}/gen.py:generate"}, DATA,
         ("--rollout-max-context-len 600", "beyond --vllm-max-model-len 512", "at most 512")),
    # -- lengths against the model's context (the tiny model's max_position_embeddings: 1024) --------------------
    Case("response-beyond-model-context", {"rollout-max-response-len": 100000}, DATA,
         ("--rollout-max-response-len 100000", "the model's context of 1024 tokens", "max_position_embeddings in",
          "config.json", "give less than 1024")),
    Case("eval-response-beyond-model-context", {"eval-max-response-len": 1024}, DATA,
         ("--eval-max-response-len 1024", "the model's context of 1024 tokens", "give less than 1024")),
    Case("vllm-max-model-len-beyond-model-context", {"vllm-max-model-len": 4096}, DATA,
         ("--vllm-max-model-len 4096", "beyond the model's context of 1024 tokens", "at most 1024")),
    Case("multi-turn-context-beyond-model-context",
         {"custom-generate-function-path": "{tmp}/gen.py:generate", "rollout-max-context-len": 2048}, DATA,
         ("--rollout-max-context-len 2048", "beyond the model's context of 1024 tokens", "at most 1024")),
    # -- built-in names -----------------------------------------------------------------------------------------
    Case("builtin-model-unknown", {"hf-checkpoint": "builtin://no-such-model"}, DATA,
         ("--hf-checkpoint builtin://no-such-model", "no such built-in model", "builtin://tiny-qwen3")),
    Case("builtin-dataset-unknown", {"prompt-data": "builtin://no-such-set"}, {},
         ("--prompt-data builtin://no-such-set", "no such built-in dataset", "builtin://arithmetic")),
    Case("builtin-eval-dataset-unknown", {"eval-prompt-data": ["aime", "builtin://aime"]}, DATA,
         ("--eval-prompt-data builtin://aime", "no such built-in dataset", "builtin://aime-synthetic")),
    # -- YAML ---------------------------------------------------------------------------------------------------
    Case("yaml-duplicate-key", yaml="num-rollout: 3\nlr: 1e-6\nnum-rollout: 30\n",
         expect=("c.yaml, line 3", "duplicate key 'num-rollout'", "line 1", "keep one")),
    Case("yaml-tab", yaml="num-rollout: 3\nlr:\n\t1e-6\n", expect=("c.yaml, line 3", "tab", "spaces")),
    Case("yaml-unclosed-list", yaml="eval-prompt-data: [aime, /d.jsonl\nlr: 1e-6\n",
         expect=("c.yaml, line 2", "']'", "flow sequence that starts on line 1", "close it")),
    Case("yaml-not-a-mapping", yaml="- num-rollout\n- 3\n", expect=("c.yaml", "mapping of flag names", "list")),
    Case("yaml-not-utf8", yaml=b"lr: 1e-6\nrm-type: caf\xe9\n", expect=("c.yaml", "not UTF-8", "save it as UTF-8")),
    Case("yaml-number-key", yaml="3: num-rollout\n", expect=("c.yaml", "3 is not a flag name")),
    # -- data rows ----------------------------------------------------------------------------------------------
    Case("data-missing-key", {}, {"data.jsonl": jsonl(GOOD_ROW, {"question": "q", "label": "1"})},
         ("--prompt-data", "data.jsonl, row 2", "no key 'prompt'", "question", "set --input-key")),
    Case("data-malformed-json", {}, {"data.jsonl": jsonl(GOOD_ROW, '{"prompt": "a", "label": }')},
         ("data.jsonl, row 2", "not valid JSON", "column 26", '"label": ⟨here⟩}', "one JSON object on one line")),
    Case("data-empty-file", {}, {"data.jsonl": "\n\n"}, ("data.jsonl", "no rows", "one JSON object per line")),
    Case("data-prompt-wrong-type", {}, {"data.jsonl": jsonl({"prompt": 7, "label": "7"})},
         ("row 1", "key 'prompt'", "found int 7")),
    Case("data-label-wrong-type", {}, {"data.jsonl": jsonl({"prompt": "p", "label": {"a": 1}})},
         ("row 1", "key 'label'", "string or a number", "found dict")),
    Case("data-not-utf8", {}, {"data.jsonl": GOOD_DATA.encode() + b'{"prompt": "caf\xe9", "label": "1"}\n'},
         ("data.jsonl, row 3", "not UTF-8", "0xe9", "convert the file to UTF-8")),
    Case("data-empty-label", {}, {"data.jsonl": jsonl(GOOD_ROW, GOOD_ROW, {"prompt": "p", "label": ""})},
         ("data.jsonl, row 3", "key 'label'", "the label is empty", "fill it in or drop the row")),
    Case("data-blank-label", {}, {"data.jsonl": jsonl({"prompt": "p", "label": "   "})}, ("row 1", "label is empty")),
    Case("data-empty-prompt", {}, {"data.jsonl": jsonl(GOOD_ROW, {"prompt": "", "label": "1"})},
         ("data.jsonl, row 2", "key 'prompt'", "the prompt is empty", "drop the row")),
    Case("data-empty-user-message", {"apply-chat-template": True},
         {"data.jsonl": jsonl(GOOD_ROW, {"prompt": [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": " "}], "label": "1"})},
         ("data.jsonl, row 2", "key 'prompt', message 1", "the user message is empty", "drop the row")),
    Case("data-bad-slice", {"prompt-data": "{tmp}/data.jsonl@[a:b]"}, DATA,
         ("data.jsonl@[a:b]", "@[START:END] with integers", "data.jsonl@[0:1000]")),
    Case("data-slice-selects-nothing", {"prompt-data": "{tmp}/data.jsonl@[5:9]"}, DATA,
         ("data.jsonl@[5:9]", "selects none of the file's 2 rows")),
    Case("data-csv", {"prompt-data": "{tmp}/data.csv"}, {"data.csv": "prompt,label\n"},
         ("data.csv", "unsupported file extension '.csv'", ".jsonl, .parquet")),
    Case("data-directory", {"prompt-data": "{tmp}/d.jsonl"}, {"d.jsonl/x": ""}, ("d.jsonl", "a directory")),
    Case("data-messages-without-chat-template", {},
         {"data.jsonl": jsonl({"prompt": [{"role": "user", "content": "2+2?"}], "label": "4"})},
         ("data.jsonl, row 1", "pass --apply-chat-template")),
    Case("data-gsm8k-label-without-number", {"rm-type": "gsm8k"}, {"data.jsonl": jsonl(GOOD_ROW, {"prompt": "p",
         "label": "five"})}, ("row 2", "'five'", "holds no number", "--rm-type")),
    Case("data-dapo-label-empty-once-normalised", {"rm-type": "dapo"},
         {"data.jsonl": jsonl({"prompt": "p", "label": "$ $"})}, ("row 1", "--rm-type dapo", "fix the row")),
    Case("data-prompt-longer-than-context", {"vllm-max-model-len": 40, "rollout-max-response-len": 20},
         {"data.jsonl": jsonl(GOOD_ROW, {"prompt": "apples " * 40, "label": "1"}, GOOD_ROW)},
         ("data.jsonl, row 2", "fills the model's context (--vllm-max-model-len 40)", "--rollout-max-prompt-len 20")),
    Case("data-every-prompt-over-max-prompt-len", {"rollout-max-prompt-len": 2}, DATA,
         ("all 2 prompts are longer than --rollout-max-prompt-len 2", "raise --rollout-max-prompt-len")),
    Case("eval-data-missing-key", {"eval-prompt-data": ["aime", "{tmp}/eval.jsonl"]},
         {**DATA, "eval.jsonl": jsonl({"problem": "p", "label": "1"})},
         ("--eval-prompt-data aime", "eval.jsonl, row 1", "no key 'prompt'", "set --eval-input-key")),
    Case("eval-data-missing", {"eval-prompt-data": ["aime", "{tmp}/no-eval.jsonl"]}, DATA,
         ("--eval-prompt-data aime", "no-eval.jsonl", "no such file")),
    Case("eval-data-empty-user-message", {"eval-prompt-data": ["aime", "{tmp}/eval.jsonl"],
         "apply-chat-template": True},
         {**DATA, "eval.jsonl": jsonl({"prompt": [{"role": "user", "content": ""}], "label": "1"})},
         ("--eval-prompt-data aime", "eval.jsonl, row 1", "message 0", "the user message is empty")),
    Case("eval-label-the-eval-reward-cannot-read", {"eval-prompt-data": ["aime", "{tmp}/eval.jsonl"],
         "eval-rm-type": "gsm8k"}, {**DATA, "eval.jsonl": jsonl({"prompt": "p", "label": "x"})},
         ("--eval-prompt-data aime", "row 1", "holds no number")),
    Case("unknown-rm-type", {"rm-type": "gsm8K"}, DATA,
         ("--rm-type 'gsm8K' is unknown", "gsm8k", "--custom-rm-path")),
    Case("unknown-eval-rm-type", {"eval-rm-type": "aime"}, DATA, ("--eval-rm-type 'aime' is unknown", "math")),
    Case("custom-reward-file-missing", {"custom-rm-path": "{tmp}/rm.py:score"}, DATA,
         ("--custom-rm-path", "rm.py", "does not exist")),
    # -- model directories --------------------------------------------------------------------------------------
    Case("model-missing", {"hf-checkpoint": "{tmp}/no-model"}, DATA,
         ("--hf-checkpoint", "no-model", "no such directory", "HF model directory")),
    Case("model-is-a-file", {"hf-checkpoint": "{tmp}/model.bin"}, {**DATA, "model.bin": "x"},
         ("--hf-checkpoint", "model.bin", "a file, not a directory")),
    Case("model-without-config", {"hf-checkpoint": "{tmp}/m"}, DATA, ("--hf-checkpoint", "no config.json",
         "found: model.safetensors"), copy_from_model("model.safetensors")),
    Case("model-config-not-json", {"hf-checkpoint": "{tmp}/m"}, {**DATA, "m/config.json": "{"},
         ("--hf-checkpoint", "config.json", "not valid JSON")),
    Case("model-without-weights", {"hf-checkpoint": "{tmp}/m"}, DATA, ("--hf-checkpoint", "no weights",
         "*.safetensors"), copy_from_model("config.json")),
    Case("model-without-tokenizer", {"hf-checkpoint": "{tmp}/m"}, DATA, ("--hf-checkpoint", "tokenizer",
         "tokenizer.json"), copy_from_model("config.json", "model.safetensors")),
    Case("model-weights-truncated", {"hf-checkpoint": "{tmp}/m"}, DATA,
         ("--hf-checkpoint", "model.safetensors: truncated or corrupt", "but its header declares",
          "download (or convert) the model again"),
         damaged_model(lambda m: _truncate(m / "model.safetensors", 1000))),
    Case("model-weights-not-safetensors", {"hf-checkpoint": "{tmp}/m"}, DATA,
         ("--hf-checkpoint", "model.safetensors: truncated or corrupt", "header length says"),
         damaged_model(lambda m: (m / "model.safetensors").write_bytes(b"<html>404 Not Found</html>"))),
    Case("model-shard-missing", {"hf-checkpoint": "{tmp}/m"}, DATA,
         ("--hf-checkpoint", "model.safetensors.index.json names 1 file(s) that are not there",
          "model-00002-of-00002.safetensors", "download (or convert) the model again"), damaged_model(_as_shards)),
    Case("ref-load-truncated", {"ref-load": "{tmp}/m", "use-kl-loss": True}, DATA,
         ("--ref-load", "model.safetensors: truncated or corrupt"),
         damaged_model(lambda m: _truncate(m / "model.safetensors", 1))),
    Case("ref-load-missing", {"ref-load": "{tmp}/ref", "use-kl-loss": True}, DATA,
         ("--ref-load", "ref", "no such directory")),
    Case("megatron-not-installed", {"train-backend": "megatron"}, DATA,
         ("--train-backend megatron", "megatron-core", "scripts/ensure-venv-megatron", "--train-backend torch")),
    Case("megatron-bridge-not-installed", {"train-backend": "megatron", "megatron-to-hf-mode": "bridge"}, DATA,
         ("--megatron-to-hf-mode bridge", "megatron-bridge", "Python >= 3.12", "scripts/ensure-venv-megatron",
          "--megatron-to-hf-mode raw")),
    Case("megatron-unmapped-family", {"train-backend": "megatron", "hf-checkpoint": "{tmp}/m"}, DATA,
         ("--hf-checkpoint", "model_type 'gpt2'", "llama, qwen2, qwen3", "--train-backend torch"),
         lambda tmp, model: _as_model_type(tmp / "m", model, "gpt2")),
    # -- checkpoints --------------------------------------------------------------------------------------------
    Case("load-missing", {"load": "{tmp}/ckpt"}, DATA, ("--load", "ckpt", "no such directory", "drop --load")),
    Case("load-is-a-file", {"load": "{tmp}/ckpt"}, {**DATA, "ckpt": "x"}, ("--load", "a file")),
    Case("load-without-checkpoint", {"load": "{tmp}/ckpt"}, {**DATA, "ckpt/notes.txt": "x"},
         ("--load", "holds no checkpoint", "rollout_NNNNNNN")),
    Case("load-of-another-model", {"load": "{tmp}/ckpt"}, DATA,
         ("--load", "rollout_0000000", "another model", "model.embed_tokens.weight is [10, 8] there"),
         lambda tmp, model: other_model_checkpoint(tmp / "ckpt")),
    Case("save-is-a-file", {"save": "{tmp}/out"}, {**DATA, "out": "x"}, ("--save", "a file, not a directory")),
    Case("save-under-a-file", {"save": "{tmp}/out/ckpt"}, {**DATA, "out": "x"},
         ("--save", "out/ckpt", "out is a file, so no directory can be made under it")),
    Case("output-dir-under-a-file", {"output-dir": "{tmp}/out/run"}, {**DATA, "out": "x"},
         ("--output-dir", "out/run", "out is a file, so no directory can be made under it",
          "give a directory for the run's logs and metrics")),
    Case("save-hf-under-a-file", {"save-hf": "{tmp}/out/a/hf"}, {**DATA, "out": "x"},
         ("--save-hf", "out is a file", "no directory can be made")),
]


def _fill(value: object, tmp: Path, model: Path) -> object:
    if isinstance(value, list):
        return [_fill(v, tmp, model) for v in value]
    return value.format(tmp=tmp, model=model) if isinstance(value, str) else value


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input_is_refused_naming_where_and_the_fix(case: Case, tmp_path: Path, tiny_model: Path, monkeypatch):
    if case.id == "megatron-not-installed":  # megatron-core is part of this environment: make it unimportable,
        for name in ["megatron", *(n for n in sys.modules if n.startswith("megatron."))]:  # imported ones too
            monkeypatch.setitem(sys.modules, name, None)
    if case.id == "megatron-bridge-not-installed":  # absent on 3.11; made unimportable where it is installed
        monkeypatch.setitem(sys.modules, "megatron.bridge", None)
    for name, content in case.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        else:
            (tmp_path / name).write_text(content)
    if case.setup is not None:
        case.setup(tmp_path, tiny_model)
    with pytest.raises(ConfigError) as info:
        if case.yaml is not None:
            config = tmp_path / "c.yaml"
            config.write_bytes(case.yaml if isinstance(case.yaml, bytes) else case.yaml.encode())
            load_yaml(config)
        else:
            flags = {k: _fill(v, tmp_path, tiny_model) for k, v in {**BASE, **case.flags}.items()}
            preflight(from_flat(resolve_config_assets(flags)))  # as the CLI builds the configuration
    message = str(info.value)
    for part in case.expect:
        assert part in message, f"{part!r} not in: {message}"


def test_the_table_covers_forty_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize(("flags", "files", "expect"), [
    ({"eval-prompt-data": ["aime", "{tmp}/no-eval.jsonl"]}, DATA, "no-eval.jsonl: no such file"),
    ({}, {"data.jsonl": jsonl(GOOD_ROW, '{"prompt": "a", "label": }')}, "data.jsonl, row 2: not valid JSON"),
    ({}, {"data.jsonl": jsonl({"question": "q", "label": "1"})}, "row 1: no key 'prompt'"),
    ({"rollout-max-response-len": 2048}, DATA, "--rollout-max-response-len 2048"),
], ids=["eval-file-missing", "bad-json", "missing-key", "response-beyond-context"])
def test_errors_that_need_no_tokenizer_are_found_by_the_checks_made_before_ray_starts(tmp_path, tiny_model, flags,
                                                                                       files, expect):
    # the driver runs check_inputs before it starts Ray, check_datasets (the tokenizer's checks) while Ray starts
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    cfg = from_flat({k: _fill(v, tmp_path, tiny_model) for k, v in {**BASE, **flags}.items()})
    with pytest.raises(PreflightError, match=re.escape(expect)):
        check_inputs(cfg)


def test_a_rope_scaled_model_may_get_a_vllm_max_model_len_beyond_its_positions(tmp_path, tiny_model):
    # vLLM derives the stretched context itself (YaRN factor 4: 4096 here); the response budget still must fit the
    # max_position_embeddings the engine gives vLLM when --vllm-max-model-len is not set
    def scaled(m: Path) -> None:
        config = json.loads((m / "config.json").read_text())
        (m / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    damaged_model(scaled)(tmp_path, tiny_model)
    (tmp_path / "data.jsonl").write_text(GOOD_DATA)
    flags = {"hf-checkpoint": str(tmp_path / "m"), "prompt-data": str(tmp_path / "data.jsonl")}
    check_inputs(from_flat({**flags, "vllm-max-model-len": 4096}))
    with pytest.raises(PreflightError, match="--rollout-max-response-len 2048 leaves no room"):
        check_inputs(from_flat({**flags, "rollout-max-response-len": 2048}))


def test_safetensors_header_is_read_without_the_tensors_and_checked_against_the_file_size(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(3, 2), "b": torch.ones(5, dtype=torch.int8)}, str(path), metadata={"format": "pt"})
    header = safetensors_header(path)
    assert {name: (spec["dtype"], spec["shape"]) for name, spec in header.items()} == {"a": ("F32", [3, 2]),
                                                                                       "b": ("I8", [5])}
    whole = path.read_bytes()
    for damaged, why in [(whole[:-1], "but its header declares"), (whole + b"\0", "but its header declares"),
                         (whole[:20], "header length says"), (whole[:5], "too short"),
                         ((4).to_bytes(8, "little") + b"[1] ", "not a safetensors header"),
                         ((2).to_bytes(8, "little") + b"{x", "not valid JSON")]:
        path.write_bytes(damaged)
        with pytest.raises(DamagedSafetensors, match=why):
            safetensors_header(path)
    path.write_bytes((2).to_bytes(8, "little") + b"{}")  # no tensors: 8 + header bytes, complete
    assert safetensors_header(path) == {}


def test_good_input_passes_preflight(tmp_path, tiny_model):
    (tmp_path / "data.jsonl").write_text(GOOD_DATA)
    flags = {"hf-checkpoint": str(tiny_model), "prompt-data": f"{tmp_path}/data.jsonl"}
    preflight(from_flat(flags))
    # reward KL with the estimators that fold it into the reward; vime's `--load X --save X` on a first run
    preflight(from_flat({**flags, "kl-coef": 0.1, "advantage-estimator": "reinforce_plus_plus",
                         "load": str(tmp_path / "ckpt"), "save": str(tmp_path / "ckpt")}))


def test_row_slices_read_the_rows_they_name_with_their_file_row_numbers(tmp_path):
    (tmp_path / "d.jsonl").write_text(jsonl(*({"prompt": f"p{i}", "label": str(i)} for i in range(6))))
    rows = read_prompt_rows(f"{tmp_path}/d.jsonl@[1:3]")
    assert [(r.row, r.record.label) for r in rows] == [(2, "1"), (3, "2")]
    assert [r.record.label for r in read_prompt_rows(f"{tmp_path}/d.jsonl@[-2:]")] == ["4", "5"]


def test_max_prompt_len_drops_longer_prompts_at_load_and_says_how_many(tmp_path, tiny_model, caplog):
    (tmp_path / "d.jsonl").write_text(jsonl(GOOD_ROW, {"prompt": "apples " * 40, "label": "1"}, GOOD_ROW))
    cfg = from_flat({"hf-checkpoint": str(tiny_model), "prompt-data": f"{tmp_path}/d.jsonl",
                     "rollout-max-prompt-len": 20})
    preflight(cfg)  # within the context; the long prompt is dropped, not refused
    with caplog.at_level(logging.WARNING):
        records = load_prompts(cfg, cfg.data.prompt_data, "prompt", "label")
    assert [r.label for r in records] == ["5", "5"]
    assert "dropped 1 of 3 prompts longer than --rollout-max-prompt-len 20" in caplog.text


def test_a_prompt_that_fits_the_context_but_not_the_response_budget_is_kept_with_a_warning(tmp_path, tiny_model,
                                                                                           caplog):
    (tmp_path / "d.jsonl").write_text(jsonl(GOOD_ROW, {"prompt": "apples " * 20, "label": "1"}))
    cfg = from_flat({"hf-checkpoint": str(tiny_model), "prompt-data": f"{tmp_path}/d.jsonl",
                     "vllm-max-model-len": 40, "rollout-max-response-len": 20})
    with caplog.at_level(logging.WARNING):
        preflight(cfg)
    assert "1 of 2 prompts leave less than the response budget of 20 tokens" in caplog.text
    assert "--rollout-max-prompt-len 20" in caplog.text


def test_dapo_never_scores_an_empty_answer_as_correct():
    assert dapo_reward("Answer: ", "") == -1.0
    assert dapo_reward("Answer:  \n", "$ $") == -1.0
    assert dapo_reward("Answer: 5", "5") == 1.0


def test_a_dangling_latest_says_which_checkpoint_is_used_instead(tmp_path, caplog):
    other_model_checkpoint(tmp_path)
    (tmp_path / ckpt.LATEST).write_text("rollout_0000009")
    with caplog.at_level(logging.WARNING):
        found = ckpt.find_latest(tmp_path)
    assert found is not None and found.rollout_id == 0
    assert "names 'rollout_0000009'" in caplog.text and "using the newest checkpoint, rollout_0000000" in caplog.text


def test_module_available_answers_for_a_missing_parent_package():
    # importlib.util.find_spec("a.b") raises ModuleNotFoundError when `a` is absent; the check must not.
    assert module_available("json.decoder") and not module_available("no_such_package_vf.core")


def test_preflight_errors_are_config_errors():
    # the pipeline's engine runner maps ConfigError to "configuration failure, do not retry"
    assert issubclass(PreflightError, ConfigError)


def test_a_family_only_the_bridge_builds_is_refused_in_raw_mode_naming_bridge_mode(tmp_path: Path, tiny_model: Path):
    # DeepSeek-V3 and GLM-4.5 have no Megatron mapping of the engine's own: Megatron-Bridge's provider builds them
    # (tests/megatron/test_bridge_families.py); a family neither builds is refused in both modes, naming those that are.
    _as_model_type(tmp_path / "m", tiny_model, "deepseek_v3")
    with pytest.raises(ConfigError, match="model_type 'deepseek_v3' .*use --megatron-to-hf-mode bridge"):
        check_megatron_mapping(str(tmp_path / "m"), "--hf-checkpoint", "raw")
    _as_model_type(tmp_path / "g", tiny_model, "gpt_neox")
    with pytest.raises(ConfigError, match="model_type 'gpt_neox' has no Megatron mapping.*deepseek_v3 with "
                                          "--megatron-to-hf-mode bridge"):
        check_megatron_mapping(str(tmp_path / "g"), "--hf-checkpoint", "bridge")


def test_vimeflow_convert_refuses_a_family_its_mode_does_not_build_before_a_model_is_read(tmp_path: Path,
                                                                                         tiny_model: Path):
    from typer.testing import CliRunner

    from flows.cli import app

    _as_model_type(tmp_path / "m", tiny_model, "deepseek_v3")
    done = CliRunner().invoke(app, ["convert", str(tmp_path / "m"), str(tmp_path / "out")])
    assert done.exit_code == 2, done.output
    assert "source " in done.output and "use --megatron-to-hf-mode bridge" in done.output
    assert not (tmp_path / "out").exists()


def test_half_precision_megatron_is_refused_on_cpu_before_ray_starts():
    # megatron-core's mixed-precision optimizer raised TypeError on CPU tensors after the model was built.
    flags = {"hf-checkpoint": "m", "prompt-data": "p", "train-backend": "megatron"}
    with pytest.raises(PreflightError, match=r"--dtype bfloat16 with --train-backend megatron on CPU: .*--dtype float32"):
        check_on_device(build_config([], **flags, dtype="bfloat16"), "cpu")
    check_on_device(build_config([], **flags, dtype="bfloat16"), "cuda")
    check_on_device(build_config([], **flags), "cpu")
    check_on_device(build_config([], **{**flags, "train-backend": "torch"}, dtype="bfloat16"), "cpu")
