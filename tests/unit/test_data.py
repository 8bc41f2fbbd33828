"""Prompt datasets (jsonl / parquet), chat rendering, the resumable DataSource, built-in sets."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from vime_engine.data import (
    BUILTIN_DATASETS,
    DatasetError,
    DataSource,
    PromptRecord,
    load_prompt_dataset,
    materialize_builtin_dataset,
    render_prompt,
)
from vime_engine.rewards import get_reward_fn

DAPO_ROWS = [
    {"prompt": [{"role": "user", "content": "Solve 1+1.\nAnswer: $Answer"}], "label": "2"},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Solve 2+2."}], "label": "4"},
]
GSM8K_ROWS = [
    {"question": "Natalia sold 48 clips and then half as many. How many?", "answer": "48/2 = 24\n48 + 24 = 72\n#### 72"},
    {"question": "Weng earns $12 an hour for 50 minutes. How much?", "answer": "12/60*50 = 10\n#### 10"},
]
AIME_ROWS = [
    {"prompt": "Find x.", "answer": 33, "id": "2024-I-1"},
    {"prompt": "Find y.", "answer": 204, "id": "2024-I-2"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path, rows):
    # Columns are the union of the rows' keys (from_pylist would keep only the first row's);
    # a row without a key holds null there, as in real parquet files.
    columns = list(dict.fromkeys(key for row in rows for key in row))
    pq.write_table(pa.table({key: [row.get(key) for row in rows] for key in columns}), path)
    return path


WRITERS = {"jsonl": write_jsonl, "parquet": write_parquet}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_dapo_math_shape(tmp_path, fmt):
    path = WRITERS[fmt](tmp_path / f"dapo.{fmt}", DAPO_ROWS)
    records = load_prompt_dataset(path)
    assert records == [
        PromptRecord(prompt=DAPO_ROWS[0]["prompt"], label="2"),
        PromptRecord(prompt=DAPO_ROWS[1]["prompt"], label="4"),
    ]


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_gsm8k_shape_takes_the_final_number_as_label(tmp_path, fmt):
    path = WRITERS[fmt](tmp_path / f"gsm8k.{fmt}", GSM8K_ROWS)
    records = load_prompt_dataset(path, input_key="question", label_key="answer")
    assert [r.prompt for r in records] == [row["question"] for row in GSM8K_ROWS]
    assert [r.label for r in records] == ["72", "10"]


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_aime_shape_with_integer_answers_and_metadata(tmp_path, fmt):
    rows = [dict(row, meta={"year": 2024, "id": row["id"]}) for row in AIME_ROWS]
    path = WRITERS[fmt](tmp_path / f"aime.{fmt}", rows)
    records = load_prompt_dataset(path, label_key="answer", metadata_key="meta")
    assert [(r.prompt, r.label) for r in records] == [("Find x.", "33"), ("Find y.", "204")]
    assert records[1].metadata == {"year": 2024, "id": "2024-I-2"}


def test_nested_label_key_and_json_metadata(tmp_path):
    rows = [{"prompt": "p", "reward_model": {"ground_truth": "7", "style": "rule"}, "extra": '{"split": "train"}'}]
    path = write_jsonl(tmp_path / "raw_dapo.jsonl", rows)
    (record,) = load_prompt_dataset(path, label_key="reward_model.ground_truth", metadata_key="extra")
    assert record.label == "7"
    assert record.metadata == {"split": "train"}


def test_blank_lines_are_skipped_but_counted(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n\n{"prompt": "b"}\n')
    with pytest.raises(DatasetError, match=r"row 3: no key 'label'"):
        load_prompt_dataset(path)


@pytest.mark.parametrize("fmt", sorted(WRITERS))
@pytest.mark.parametrize(
    ("rows", "kwargs", "message"),
    [
        (
            [{"prompt": "ok", "label": "1"}, {"question": "q", "answer": "2"}],
            {},
            r"row 2: no key 'prompt' \(keys found: question, answer\); set --input-key",
        ),
        (
            [{"prompt": "ok", "label": "1"}, {"prompt": "ok", "answer": "2"}],
            {},
            r"row 2: no key 'label' \(keys found: prompt, answer\); set --label-key",
        ),
        ([{"prompt": "ok", "label": "1", "m": 1}], {"metadata_key": "m"}, r"row 1, key 'm': expected metadata as an object"),
        ([{"prompt": 5, "label": "1"}], {}, r"row 1, key 'prompt': expected a prompt string .*found int 5"),
        ([{"prompt": "   ", "label": "1"}], {}, r"row 1, key 'prompt': the prompt is empty; write it or drop"),
        (
            [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": c}], "label": "1"}
             for c in ("ok", "\n")],
            {},
            r"row 2, key 'prompt', message 1: the user message is empty; write it or drop the row",
        ),
        ([{"prompt": [{"role": "user"}], "label": "1"}], {}, r"row 1, key 'prompt', message 0: expected \{\"role\": str"),
        ([{"prompt": "ok", "label": ["1", "2"]}], {}, r"row 1, key 'label': expected the label as a string or a number, found list"),
    ],
)
def test_errors_name_file_row_and_key(tmp_path, fmt, rows, kwargs, message):
    path = WRITERS[fmt](tmp_path / f"bad.{fmt}", rows)
    with pytest.raises(DatasetError, match=message) as info:
        load_prompt_dataset(path, **kwargs)
    assert str(info.value).startswith(str(path))


def test_an_empty_system_or_assistant_message_is_kept(tmp_path):
    # only the user's turn must say something: an empty system prompt or a prefilled empty answer is a choice
    rows = [{"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": ""}], "label": "1"}]
    assert load_prompt_dataset(write_jsonl(tmp_path / "chat.jsonl", rows))[0].prompt == rows[0]["prompt"]


def test_unreadable_jsonl_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": \n')
    with pytest.raises(DatasetError, match=r"broken.jsonl, row 2: not valid JSON"):
        load_prompt_dataset(path)
    path.write_text('["not", "an", "object"]\n')
    with pytest.raises(DatasetError, match=r"row 1: expected a JSON object, found list"):
        load_prompt_dataset(path)


def test_file_level_errors(tmp_path):
    with pytest.raises(DatasetError, match=r"unsupported file extension '.csv'; supported: .jsonl, .parquet"):
        load_prompt_dataset(tmp_path / "data.csv")
    with pytest.raises(DatasetError, match="no such file"):
        load_prompt_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="has no rows"):
        load_prompt_dataset(tmp_path / "empty.jsonl")
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="cannot read as parquet"):
        load_prompt_dataset(tmp_path / "fake.parquet")
    assert issubclass(DatasetError, ValueError)


# --- chat rendering --------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"[UNK]": 0, "<|end|>": 1, "hello": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<|end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_render_string_prompt_with_chat_template(tokenizer):
    record = PromptRecord(prompt="What is 2 + 3?", label="5")
    assert render_prompt(record, tokenizer, apply_chat_template=True) == "<|user|>What is 2 + 3?<|end|><|assistant|>"


def test_render_messages_with_chat_template(tokenizer):
    record = PromptRecord(prompt=DAPO_ROWS[1]["prompt"], label="4")
    assert (
        render_prompt(record, tokenizer, apply_chat_template=True)
        == "<|system|>Be brief.<|end|><|user|>Solve 2+2.<|end|><|assistant|>"
    )


def test_render_without_chat_template(tokenizer):
    assert render_prompt(PromptRecord(prompt="raw text", label="1"), None, apply_chat_template=False) == "raw text"
    with pytest.raises(ValueError, match="pass --apply-chat-template"):
        render_prompt(PromptRecord(prompt=DAPO_ROWS[0]["prompt"], label="2"), tokenizer, apply_chat_template=False)


def test_render_with_a_tokenizer_lacking_a_template(tokenizer):
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="[UNK]")
    with pytest.raises(ValueError, match="--apply-chat-template is set but the tokenizer has no chat template"):
        render_prompt(PromptRecord(prompt="hi", label="1"), bare, apply_chat_template=True)


# --- DataSource ------------------------------------------------------------------------------


def numbered(n):
    return [PromptRecord(prompt=f"p{i}", label=str(i)) for i in range(n)]


def labels(batch):
    return [int(r.label) for r in batch]


def test_unshuffled_source_walks_in_order_across_epochs():
    source = DataSource(numbered(5), shuffle=False, seed=0)
    assert len(source) == 5
    assert labels(source.next_batch(3)) == [0, 1, 2]
    assert labels(source.next_batch(3)) == [3, 4, 0]  # crosses into epoch 1
    assert source.epoch == 1
    assert labels(source.next_batch(12)) == [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]
    assert source.state_dict()["epoch"] == 3


def test_shuffled_epochs_are_permutations_that_differ():
    source = DataSource(numbered(10), shuffle=True, seed=7)
    epochs = [labels(source.next_batch(10)) for _ in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(10))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(10))


def test_same_seed_same_batches_and_other_seed_other_batches():
    def walk(seed):
        source = DataSource(numbered(17), shuffle=True, seed=seed)
        return [labels(source.next_batch(4)) for _ in range(12)]

    assert walk(3) == walk(3)
    assert walk(3) != walk(4)


def test_epoch_crossing_batch_takes_the_next_epochs_permutation():
    source = DataSource(numbered(6), shuffle=True, seed=1)
    reference = DataSource(numbered(6), shuffle=True, seed=1)
    full = labels(reference.next_batch(6)) + labels(reference.next_batch(6))
    assert labels(source.next_batch(4)) + labels(source.next_batch(4)) + labels(source.next_batch(4)) == full


def test_shuffle_ignores_global_rng_state():
    def first_batches():
        source = DataSource(numbered(20), shuffle=True, seed=11)
        return [labels(source.next_batch(7)) for _ in range(4)]

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    baseline = first_batches()
    random.seed(12345)
    np.random.seed(54321)
    torch.manual_seed(999)
    random.random()
    np.random.random()
    torch.rand(3)
    assert first_batches() == baseline


@pytest.mark.parametrize("shuffle", [True, False])
def test_restored_source_continues_with_the_same_batches(shuffle):
    records = numbered(13)
    original = DataSource(records, shuffle=shuffle, seed=5)
    for _ in range(4):
        original.next_batch(5)  # stops mid-epoch (20 = 13 + 7)
    state = json.loads(json.dumps(original.state_dict()))  # must survive a JSON round trip
    assert state["epoch"] == 1 and state["offset"] == 7

    restored = DataSource(records, shuffle=shuffle, seed=5)
    restored.load_state_dict(state)
    assert [labels(restored.next_batch(5)) for _ in range(6)] == [labels(original.next_batch(5)) for _ in range(6)]


def test_state_from_another_source_is_refused():
    state = DataSource(numbered(8), shuffle=True, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_records: saved 8, now 9"):
        DataSource(numbered(9), shuffle=True, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        DataSource(numbered(8), shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="invalid cursor"):
        DataSource(numbered(8), shuffle=True, seed=1).load_state_dict(dict(state, offset=9))


def test_source_argument_errors():
    with pytest.raises(ValueError, match="at least one"):
        DataSource([], shuffle=False, seed=0)
    with pytest.raises(ValueError, match="batch size must be positive"):
        DataSource(numbered(2), shuffle=False, seed=0).next_batch(0)


# --- built-in synthetic datasets ------------------------------------------------------------


def test_builtin_datasets_are_byte_identical_across_calls(tmp_path):
    for name in BUILTIN_DATASETS:
        first = materialize_builtin_dataset(name, tmp_path / "a").read_bytes()
        path = materialize_builtin_dataset(name, tmp_path / "a")
        assert path == tmp_path / "a" / f"{name}.jsonl"
        assert path.read_bytes() == first
        assert materialize_builtin_dataset(name, tmp_path / "b").read_bytes() == first
        path.write_text("tampered\n")
        assert materialize_builtin_dataset(name, tmp_path / "a").read_bytes() == first


def test_unknown_builtin_dataset_lists_the_names(tmp_path):
    with pytest.raises(ValueError, match="unknown built-in dataset 'gsm9k'; choose one of: arithmetic, aime-synthetic"):
        materialize_builtin_dataset("gsm9k", tmp_path)


def test_arithmetic_answers_are_correct(tmp_path):
    path = materialize_builtin_dataset("arithmetic", tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2000
    for row in rows:
        a, b = (int(x) for x in re.findall(r"\d+", row["question"]))
        subtract = re.search(r"minus|gives|takes", row["question"]) is not None
        expected = a - b if subtract else a + b
        assert a < 100 and b < 100 and expected >= 0
        assert row["answer"].endswith(f"\n#### {expected}"), row
        # The worked solution itself scores full marks under the demo's reward.
        assert get_reward_fn("gsm8k")(row["answer"], str(expected)) == 1.0
    assert any(max(map(int, re.findall(r"\d+", row["question"]))) < 10 for row in rows)
    records = load_prompt_dataset(path, input_key="question", label_key="answer")
    assert records[0].label == rows[0]["answer"].rsplit("#### ", 1)[1]


def test_aime_synthetic_answers_are_correct(tmp_path):
    path = materialize_builtin_dataset("aime-synthetic", tmp_path)
    records = load_prompt_dataset(path)
    assert len(records) == 30
    checked = 0
    for record in records:
        assert "\\boxed{}" in record.prompt
        assert 0 <= int(record.label) <= 999
        power = re.match(r"Find the remainder when \$(\d+)\^\{(\d+)\}\$ is divided by \$(\d+)\$", record.prompt)
        if power:
            base, exponent, modulus = map(int, power.groups())
            assert int(record.label) == base**exponent % modulus
            checked += 1
        pairs = re.match(r"How many ordered pairs .* \$x \+ 2y = (\d+)\$", record.prompt)
        if pairs:
            total = int(pairs.group(1))
            assert int(record.label) == sum(1 for y in range(total + 1) if total - 2 * y >= 0)
            checked += 1
        divisible = re.match(r"How many positive integers .* \$(\d+)\$ are divisible by \$(\d+)\$ or \$(\d+)\$", record.prompt)
        if divisible:
            limit, p, q = map(int, divisible.groups())
            assert int(record.label) == sum(1 for k in range(1, limit + 1) if k % p == 0 or k % q == 0)
            checked += 1
        digits = re.match(r"Find the sum of the digits of \$2\^\{(\d+)\}\$", record.prompt)
        if digits:
            assert int(record.label) == sum(map(int, str(2 ** int(digits.group(1)))))
            checked += 1
    assert checked >= 15
