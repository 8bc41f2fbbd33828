"""The CPU demo's built-in datasets: `arithmetic-demo` (training) and `arithmetic-demo-eval` (held out)."""

from __future__ import annotations

import json
import re

import pytest

from vime_engine.assets import resolve_config_assets
from vime_engine.config import from_flat, load_yaml
from vime_engine.data import BUILTIN_DATASETS, load_prompt_dataset, materialize_builtin_dataset
from vime_engine.rewards import get_reward_fn

QUESTION = re.compile(r"What is (\d) ([+-]) (\d)\?")
DEMO_CONFIGS = ("configs/demo-engine.yaml", "configs/train-demo.yaml")


def rows_of(name, tmp_path):
    path = materialize_builtin_dataset(name, tmp_path)
    return [json.loads(line) for line in path.read_text().splitlines()]


def operand_pair(question: str) -> frozenset[int]:
    a, _, b = QUESTION.fullmatch(question).groups()
    return frozenset((int(a), int(b)))


def test_demo_sets_are_listed_after_the_older_names():
    assert list(BUILTIN_DATASETS)[:2] == ["arithmetic", "aime-synthetic"]
    assert {"arithmetic-demo", "arithmetic-demo-eval"} <= set(BUILTIN_DATASETS)


@pytest.mark.parametrize("name", ["arithmetic-demo", "arithmetic-demo-eval"])
def test_demo_answers_are_correct_and_score_full_marks(tmp_path, name):
    reward = get_reward_fn("gsm8k")
    for row in rows_of(name, tmp_path):
        a, op, b = QUESTION.fullmatch(row["question"]).groups()
        a, b = int(a), int(b)
        expected = a + b if op == "+" else a - b
        assert 1 <= a <= 9 and 1 <= b <= 9 and expected >= 0, row
        assert row["answer"] == f"{a} {op} {b} = {expected}.\n#### {expected}"
        assert reward(row["answer"], str(expected)) == 1.0
        # The plain-text way SmolLM2 answers is graded right, a wrong final number wrong.
        assert reward(f"{a} {op} {b} = {expected}", row["answer"]) == 1.0
        assert reward(f"{a} {op} {b} = {expected + 1}", row["answer"]) == 0.0


def test_split_covers_every_one_digit_problem_once_and_holds_out_whole_pairs(tmp_path):
    train, held_out = rows_of("arithmetic-demo", tmp_path), rows_of("arithmetic-demo-eval", tmp_path)
    questions = [r["question"] for r in train + held_out]
    every = {f"What is {a} + {b}?" for a in range(1, 10) for b in range(1, 10)}
    every |= {f"What is {a} - {b}?" for a in range(1, 10) for b in range(1, a + 1)}
    assert len(questions) == len(set(questions)) == len(every) == 126
    assert set(questions) == every
    # No held-out problem's commuted sum or difference leaks into training.
    assert not {operand_pair(r["question"]) for r in train} & {operand_pair(r["question"]) for r in held_out}
    assert len({operand_pair(r["question"]) for r in held_out}) == 11
    assert 25 <= len(held_out) <= 33 and len(train) == 126 - len(held_out)


def test_demo_sets_are_not_ordered_by_difficulty(tmp_path):
    train = rows_of("arithmetic-demo", tmp_path)
    results = [int(r["answer"].rsplit("#### ", 1)[1]) for r in train]
    assert results != sorted(results) and results != sorted(results, reverse=True)
    assert {r["question"].split()[3] for r in train[:12]} == {"+", "-"}


def test_demo_sets_load_as_gsm8k_prompts_with_numeric_labels(tmp_path):
    path = materialize_builtin_dataset("arithmetic-demo-eval", tmp_path)
    records = load_prompt_dataset(path, input_key="question", label_key="answer")
    rows = rows_of("arithmetic-demo-eval", tmp_path / "again")
    assert [r.prompt for r in records] == [row["question"] for row in rows]
    assert [r.label for r in records] == [row["answer"].rsplit("#### ", 1)[1] for row in rows]


@pytest.mark.parametrize("config", DEMO_CONFIGS)
def test_demo_configs_train_on_the_demo_split_and_evaluate_on_the_held_out_one_and_aime(tmp_path, monkeypatch,
                                                                                        config):
    monkeypatch.setenv("VIMEFLOW_CACHE", str(tmp_path))
    values = load_yaml(config)
    resolved = resolve_config_assets({k: v for k, v in values.items() if k != "hf-checkpoint"})
    cfg = from_flat({**resolved, "hf-checkpoint": "unused"})
    assert cfg.data.prompt_data == str(tmp_path / "datasets" / "arithmetic-demo.jsonl")
    assert cfg.eval_datasets == [("held-out", str(tmp_path / "datasets" / "arithmetic-demo-eval.jsonl")),
                                 ("aime", str(tmp_path / "datasets" / "aime-synthetic.jsonl"))]
    assert cfg.reward.rm_type == "gsm8k" and cfg.eval.eval_rm_type is None and cfg.eval.eval_input_key is None
    # The AIME-shaped set reads with the demo's keys and its answers grade with the demo's reward.
    aime = load_prompt_dataset(cfg.eval_datasets[1][1], input_key=cfg.data.input_key, label_key=cfg.data.label_key)
    assert len(aime) == 30 and all("\\boxed{}" in r.prompt for r in aime)
    assert all(get_reward_fn("gsm8k")(f"so the answer is \\boxed{{{r.label}}}", r.label) == 1.0 for r in aime)


def test_the_two_demo_configs_agree_on_every_training_value():
    engine, default = load_yaml(DEMO_CONFIGS[0]), load_yaml(DEMO_CONFIGS[1])
    per_run = {"output-dir", "save", "save-interval"}
    assert {k: v for k, v in engine.items() if k not in per_run} == {
        k: v for k, v in default.items() if k not in per_run
    }
