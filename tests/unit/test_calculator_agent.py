"""The calculator tool, its reply through the chat template, the agent's reward, and the built-in task."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from vime_engine.agents.calculator import CalculatorError, calculate, find_tool_call, reply
from vime_engine.agents.calculator_agent import final_answer_reward, open_turn_length
from vime_engine.agents.chat_turns import tool_reply_text, tool_reply_tokens
from vime_engine.data.synthetic import CALCULATOR_EVAL_ROWS, CALCULATOR_ROWS, materialize_builtin_dataset


@pytest.mark.parametrize("expression, value", [
    ("47 * 23 + 18", 1099), ("(11 + 12) * 3", 69), ("-4 - -6", 2), ("7 / 2", 3.5), ("7 // 2", 3), ("7 % 4", 3),
    ("2 ** 10", 1024), ("2^10", 1024), ("1.5 * 4", 6.0), (" 3 ", 3),
])
def test_arithmetic_is_evaluated(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "only numbers"), ("open('/etc/passwd')", "only numbers"),
    ("x + 1", "only numbers"), ("(1).__class__", "only numbers"), ("'a' * 3", "only numbers"),
    ("[1, 2]", "only numbers"), ("1 / 0", "division by zero"), ("9 ** 99", "exponent"),
    ("10 ** 30", "larger than"), ("1e308 * 10", "larger than"), ("1 +", "not an arithmetic expression"),
    ("1" * 201, "longer than"), ("(-8) ** 0.5", "not a real number"),
])
def test_anything_but_bounded_arithmetic_is_refused(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculate(expression)


def test_the_reply_is_what_the_model_reads():
    assert reply("12 * 34 + 56") == "464"
    assert reply("6 / 3") == "2"  # an integral result without a decimal point
    assert reply("1 / 3") == "0.3333333333"
    assert reply("1 / 0") == "error: division by zero"


def test_the_first_complete_tool_call_is_found():
    assert find_tool_call("Let me compute. <tool_call> 3 * 4 </tool_call> then <tool_call>1</tool_call>") == "3 * 4"
    assert find_tool_call("<tool_call>3 * 4") is None
    assert find_tool_call("The answer is 12.") is None


def test_the_tool_reply_continues_the_conversation_as_the_chat_template_renders_it(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert tool_reply_text(tokenizer, "<tool_response>464</tool_response>") == (
        "\n<|im_start|>tool\n<tool_response>464</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # Prompt + the model's turn (ending in EOS) + the reply = the template's own rendering of the conversation.
    question = [{"role": "user", "content": "What is 12 * 34 + 56?"}]
    call = "<tool_call>12 * 34 + 56</tool_call>"
    prompt = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(
        question + [{"role": "assistant", "content": call}, {"role": "tool", "content": "464"}], tokenize=False,
        add_generation_prompt=True)
    assert prompt + call + tokenizer.eos_token + tool_reply_text(tokenizer, "464") == whole
    assert tokenizer.decode(tool_reply_tokens(tokenizer, "464")) == tool_reply_text(tokenizer, "464")


def test_only_the_models_last_turn_after_the_tool_earns_the_reward():
    transcript = "<tool_call>47 * 23 + 18</tool_call>\ntool\n<tool_response>1099</tool_response>\nassistant\n"
    assert final_answer_reward(transcript + "The answer is 1099.", "1099") == 1.0
    assert final_answer_reward(transcript + "The answer is 1100.", "1099") == 0.0
    assert final_answer_reward(transcript, "1099") == 0.0  # the calculator's number does not count
    assert final_answer_reward("47 * 23 + 18 = 1099", "1099") == 1.0  # no tool: the whole answer is graded


def test_an_unfinished_turn_is_the_trailing_run_of_trained_tokens():
    assert open_turn_length([1, 1, 0, 0, 1, 1, 1]) == 3
    assert open_turn_length([1, 1, 0]) == 0 and open_turn_length([]) == 0


def test_calculator_task_labels_are_the_values_of_the_questions(tmp_path):
    for name, count in (("calculator", CALCULATOR_ROWS), ("calculator-eval", CALCULATOR_EVAL_ROWS)):
        rows = [json.loads(line) for line in materialize_builtin_dataset(name, tmp_path).read_text().splitlines()]
        assert len(rows) == count
        for row in rows:
            messages = row["prompt"]
            assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
            question = messages[-1]["content"]
            assert question.startswith("What is ") and question.endswith("?")
            assert reply(question[len("What is "):-1]) == row["label"]
    train = {json.dumps(r) for r in map(json.loads, (tmp_path / "calculator.jsonl").read_text().splitlines())}
    held = {json.dumps(r) for r in map(json.loads, (tmp_path / "calculator-eval.jsonl").read_text().splitlines())}
    assert len(train & held) <= 1  # independent draws: a repeat is chance


def test_the_agent_runs_with_vimes_signature():
    from vime_engine.rollout.custom_generate import load_generate_function

    fn = load_generate_function("vime_engine.agents.calculator_agent:generate")
    assert asyncio.iscoroutinefunction(fn)


def test_the_shipped_agent_demo_config_runs_the_calculator_agent():
    from flows.configs import config_file
    from vime_engine.config import build_config

    cfg = build_config(yaml_path=config_file("agent-demo.yaml"))
    assert cfg.rollout.custom_generate_function_path == "vime_engine.agents.calculator_agent:generate"
    assert cfg.reward.custom_rm_path == "vime_engine.agents.calculator_agent:final_answer_reward"
    assert cfg.data.prompt_data == "builtin://calculator" and cfg.rollout.rollout_max_turns == 3
