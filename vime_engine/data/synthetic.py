"""Built-in synthetic prompt datasets, generated from a fixed seed so nothing comes from the network.

- `arithmetic`: one- and two-digit additions and subtractions as gsm8k-shaped word problems
  (`question`, `answer` = a one-line worked solution and a final `#### N` line). Small models
  can learn these, which is what the CPU demo needs.
- `arithmetic-demo` / `arithmetic-demo-eval`: every one-digit sum and difference ("What is 7 + 5?"),
  split by operand pair into a training set and a held-out evaluation set. SmolLM2-135M-Instruct gets
  about a third of these right when sampled, so GRPO groups have reward variance from the first rollout.
- `calculator` / `calculator-eval`: two-step arithmetic on two-digit numbers ("What is 47 * 23 + 18?") as a chat
  (`prompt`: a system message offering a calculator tool, one worked example of a tool call, the question;
  `label`: the integer answer), for the calculator agent (vime_engine/agents/calculator_agent.py).
  SmolLM2-135M-Instruct gets none right on its own; it calls the tool in about 45% of episodes and answers
  right after nearly every call, so the reward is about the share of episodes that use the tool.
- `aime-synthetic`: AIME-shaped rows (`prompt`, `label`): problems from templates whose integer
  answer (0-999) is computed, with the instruction to box the final answer. Each row holds the same problem
  and answer under `question` / `answer` too, so a run whose keys are gsm8k's (the CPU demo) evaluates on it.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

ARITHMETIC_ROWS = 2000
AIME_ROWS = 30
DEMO_EVAL_PAIRS = 11  # unordered operand pairs held out of `arithmetic-demo` for `arithmetic-demo-eval`
_SEED = 20241129

BOX_INSTRUCTION = "The answer is an integer from 0 to 999. Put your final answer within \\boxed{}."

_NAMES = ("Tom", "Anna", "Lily", "Omar", "Mia", "Ravi", "Sofia", "Ken", "Zoe", "Ivan")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "cards")

Row = dict[str, str]


def _small_number(rng: random.Random) -> int:
    # Half one-digit, half two-digit: tiny models get some problems right from the start,
    # which GRPO needs for a non-zero advantage.
    return rng.randint(1, 9) if rng.random() < 0.5 else rng.randint(10, 99)


def _arithmetic_row(rng: random.Random) -> Row:
    """One gsm8k-shaped word problem; operands below 100, results never negative."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = _small_number(rng), _small_number(rng)
    kind = rng.randrange(6)
    if kind == 0:
        question = f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have?"
        work = f"{name} has {a} + {b} = {a + b} {item}."
        result = a + b
    elif kind == 1:
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {item} and gives {b} to a friend. How many {item} does {name} have left?"
        work = f"{name} has {a} - {b} = {a - b} {item} left."
        result = a - b
    elif kind == 2:
        question = f"There are {a} birds on a tree. Then {b} more birds land on it. How many birds are on the tree now?"
        work = f"There are {a} + {b} = {a + b} birds on the tree."
        result = a + b
    elif kind == 3:
        a, b = max(a, b), min(a, b)
        question = f"A box holds {a} {item}. {name} takes {b} of them away. How many {item} are left in the box?"
        work = f"The box has {a} - {b} = {a - b} {item} left."
        result = a - b
    elif kind == 4:
        question = f"What is {a} plus {b}?"
        work = f"{a} + {b} = {a + b}."
        result = a + b
    else:
        a, b = max(a, b), min(a, b)
        question = f"What is {a} minus {b}?"
        work = f"{a} - {b} = {a - b}."
        result = a - b
    return {"question": question, "answer": f"{work}\n#### {result}"}


def _aime_power_mod(rng: random.Random) -> tuple[str, int]:
    base, exponent, modulus = rng.randint(2, 19), rng.randint(10, 99), rng.choice((7, 11, 13, 17, 100, 1000))
    return f"Find the remainder when ${base}^{{{exponent}}}$ is divided by ${modulus}$.", pow(base, exponent, modulus)


def _aime_divisible_count(rng: random.Random) -> tuple[str, int]:
    limit = rng.randint(200, 999)
    p, q = rng.sample((2, 3, 5, 7, 11), 2)
    count = limit // p + limit // q - limit // (p * q)
    return f"How many positive integers less than or equal to ${limit}$ are divisible by ${p}$ or ${q}$?", count


def _aime_arithmetic_series(rng: random.Random) -> tuple[str, int]:
    first, step, terms = rng.randint(1, 20), rng.randint(2, 9), rng.randint(20, 80)
    total = terms * (2 * first + (terms - 1) * step) // 2
    last = first + (terms - 1) * step
    return (
        f"Let $S = {first} + {first + step} + {first + 2 * step} + \\cdots + {last}$, the sum of the arithmetic "
        f"sequence with {terms} terms. Find the remainder when $S$ is divided by $1000$.",
        total % 1000,
    )


def _aime_lattice_pairs(rng: random.Random) -> tuple[str, int]:
    total = rng.randint(10, 60)
    # Ordered pairs of non-negative integers with x + 2y = total: y ranges over 0..total//2.
    return f"How many ordered pairs of non-negative integers $(x, y)$ satisfy $x + 2y = {total}$?", total // 2 + 1


def _aime_digit_sum(rng: random.Random) -> tuple[str, int]:
    exponent = rng.randint(20, 120)
    return f"Find the sum of the digits of $2^{{{exponent}}}$.", sum(int(d) for d in str(2**exponent))


def _aime_lcm(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(12, 400), rng.randint(12, 400)
    return (
        f"Let $L$ be the least common multiple of ${a}$ and ${b}$. Find the remainder when $L$ is divided by $1000$.",
        math.lcm(a, b) % 1000,
    )


_AIME_TEMPLATES: tuple[Callable[[random.Random], tuple[str, int]], ...] = (
    _aime_power_mod,
    _aime_divisible_count,
    _aime_arithmetic_series,
    _aime_lattice_pairs,
    _aime_digit_sum,
    _aime_lcm,
)


def _aime_row(index: int, rng: random.Random) -> Row:
    problem, answer = _AIME_TEMPLATES[index % len(_AIME_TEMPLATES)](rng)
    assert 0 <= answer <= 999, (problem, answer)  # the templates' ranges guarantee it
    prompt = f"{problem}\n\n{BOX_INSTRUCTION}"
    return {"prompt": prompt, "label": str(answer), "question": prompt, "answer": str(answer)}


def arithmetic_rows() -> list[Row]:
    rng = random.Random(_SEED)
    return [_arithmetic_row(rng) for _ in range(ARITHMETIC_ROWS)]


def aime_synthetic_rows() -> list[Row]:
    rng = random.Random(_SEED)
    return [_aime_row(i, rng) for i in range(AIME_ROWS)]


CALCULATOR_ROWS, CALCULATOR_EVAL_ROWS = 1000, 64
CALCULATOR_SYSTEM = (
    "You are a helpful assistant with a calculator tool. To use it, write <tool_call>expression</tool_call> "
    "and the result comes back in a tool message. Then give the final answer."
)
_CALCULATOR_EXAMPLE = [
    {"role": "user", "content": "What is 12 * 34 + 56?"},
    {"role": "assistant", "content": "<tool_call>12 * 34 + 56</tool_call>"},
    {"role": "tool", "content": "<tool_response>464</tool_response>"},
    {"role": "assistant", "content": "The answer is 464."},
]


def _calculator_row(rng: random.Random) -> dict:
    a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(11, 99)
    kind = rng.randrange(3)
    if kind == 0:
        question, answer = f"What is {a} * {b} + {c}?", a * b + c
    elif kind == 1:
        question, answer = f"What is {a} * {b} - {c}?", a * b - c
    else:
        question, answer = f"What is ({a} + {b}) * {c}?", (a + b) * c
    messages = [{"role": "system", "content": CALCULATOR_SYSTEM}, *_CALCULATOR_EXAMPLE,
                {"role": "user", "content": question}]
    return {"prompt": messages, "label": str(answer)}


def calculator_rows() -> list[dict]:
    rng = random.Random(_SEED)
    return [_calculator_row(rng) for _ in range(CALCULATOR_ROWS)]


def calculator_eval_rows() -> list[dict]:
    rng = random.Random(_SEED + 1)  # another stream: problems independent of training (a repeat is chance)
    return [_calculator_row(rng) for _ in range(CALCULATOR_EVAL_ROWS)]


def _demo_pair_rows(a: int, b: int) -> list[Row]:
    """The problems on one unordered operand pair a <= b: a + b, b + a (when distinct) and b - a."""
    orders = [(a, b)] if a == b else [(a, b), (b, a)]
    rows = [{"question": f"What is {x} + {y}?", "answer": f"{x} + {y} = {x + y}.\n#### {x + y}"} for x, y in orders]
    rows.append({"question": f"What is {b} - {a}?", "answer": f"{b} - {a} = {b - a}.\n#### {b - a}"})
    return rows


def _demo_split() -> tuple[list[Row], list[Row]]:
    """(train, held-out) rows over all one-digit operand pairs 1 <= a <= b <= 9.

    The pairs are shuffled with the fixed seed and the first `DEMO_EVAL_PAIRS` are held out, so no
    evaluation problem, nor its commuted sum or its difference, appears in training. Each side keeps
    the shuffled pair order, so neither file is sorted by difficulty.
    """
    pairs = [(a, b) for a in range(1, 10) for b in range(a, 10)]
    random.Random(_SEED).shuffle(pairs)
    held_out = [row for pair in pairs[:DEMO_EVAL_PAIRS] for row in _demo_pair_rows(*pair)]
    train = [row for pair in pairs[DEMO_EVAL_PAIRS:] for row in _demo_pair_rows(*pair)]
    return train, held_out


def arithmetic_demo_rows() -> list[Row]:
    return _demo_split()[0]


def arithmetic_demo_eval_rows() -> list[Row]:
    return _demo_split()[1]


_BUILDERS: dict[str, Callable[[], list[Row]]] = {
    "arithmetic": arithmetic_rows,
    "aime-synthetic": aime_synthetic_rows,
    "arithmetic-demo": arithmetic_demo_rows,
    "arithmetic-demo-eval": arithmetic_demo_eval_rows,
    "calculator": calculator_rows,
    "calculator-eval": calculator_eval_rows,
}

BUILTIN_DATASETS: dict[str, str] = {
    "arithmetic": f"{ARITHMETIC_ROWS} one/two-digit addition and subtraction word problems, gsm8k shape "
                  "(question, answer '#### N')",
    "aime-synthetic": f"{AIME_ROWS} AIME-shaped problems with computed integer answers 0-999 (prompt, label; also "
                      "question, answer), answer in \\boxed{}",
    "arithmetic-demo": "one-digit sums and differences ('What is 7 + 5?'), gsm8k shape: training split for the CPU "
                       "demo",
    "arithmetic-demo-eval": f"the {DEMO_EVAL_PAIRS} operand pairs held out of arithmetic-demo, same shape: its "
                            "evaluation split",
    "calculator": f"{CALCULATOR_ROWS} two-step problems on two-digit numbers as chats offering a calculator tool "
                  "(prompt messages, label): the calculator agent's task",
    "calculator-eval": f"{CALCULATOR_EVAL_ROWS} more of them from another seed: its evaluation set",
}


def materialize_builtin_dataset(name: str, dest_dir: Path) -> Path:
    """Write built-in dataset `name` to `<dest_dir>/<name>.jsonl` and return that path.

    The bytes depend only on the name (fixed seed, fixed key order, `\\n` line ends), so calling
    it again leaves an identical file. A file already holding those bytes is not rewritten; any
    other content is replaced atomically (write to a temporary file, then rename).
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown built-in dataset {name!r}; choose one of: {', '.join(BUILTIN_DATASETS)}")
    content = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in _BUILDERS[name]()).encode("utf-8")
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / f"{name}.jsonl"
    if path.is_file() and path.read_bytes() == content:
        return path
    fd, tmp_name = tempfile.mkstemp(dir=dest_dir, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path
