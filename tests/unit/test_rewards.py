"""Reward functions on hand-picked responses, and loading a custom one."""

from __future__ import annotations

import sys
import textwrap
import threading

import pytest

from vime_engine.rewards import BUILTIN_REWARDS, get_reward_fn
from vime_engine.rewards.boxed import last_boxed_content
from vime_engine.rewards.dapo import dapo_reward
from vime_engine.rewards.deepscaler import deepscaler_reward
from vime_engine.rewards.gsm8k import gsm8k_reward
from vime_engine.rewards.math import math_reward


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\{1, \{2\}\}}", r"\{1, \{2\}\}"),
        (r"\fbox{7}", "7"),
        (r"\boxed {8}", "8"),
        (r"\boxed{3} and an unclosed \boxed{4", "3"),
        ("no box here", None),
        (r"\boxed 5", None),
    ],
)
def test_last_boxed_content(text, content):
    assert last_boxed_content(text) == content


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        (r"The answer is \boxed{42}.", "42", 1.0),
        (r"The answer is \boxed{41}.", "42", 0.0),
        ("The answer is 42.", "42", 0.0),  # no boxed answer
        (r"\boxed{}", "0", 0.0),
        (r"first \boxed{1}, finally \boxed{2}", "2", 1.0),
        (r"first \boxed{2}, finally \boxed{1}", "2", 0.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
        (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
        (r"\boxed{x^2 + 1}", "1 + x^2", 1.0),
        (r"\fbox{12}", "12", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{\text{Monday}}", "Monday", 1.0),
        (r"\boxed{\text{Tuesday}}", "Monday", 0.0),
        (r"\boxed{6}", r"The area is \boxed{6}", 1.0),  # a boxed label is reduced to its box
        # math-verify cannot parse "3." (trailing period); the sympy fallback decides.
        (r"\boxed{3.}", "3", 1.0),
        (r"\boxed{3.}", "4", 0.0),
        (r"\boxed{0.5\ }", r"\frac{1}{2}", 1.0),
    ],
)
def test_math_reward(response, label, reward):
    assert math_reward(response, label) == reward


def test_math_reward_off_the_main_thread():
    # math-verify's SIGALRM timeouts only work in the main thread; rewards also run in workers.
    results = []
    worker = threading.Thread(target=lambda: results.append(math_reward(r"\boxed{\frac{2}{4}}", "0.5")))
    worker.start()
    worker.join()
    assert results == [1.0]


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("2 + 3 = 5.", "5", 1.0),
        ("2 + 3 = 5.", "6", 0.0),
        ("Tom has 3 + 4 = 7 apples.", "7", 1.0),
        ("It costs $1,234 in total.", "1234", 1.0),
        ("The answer is 3.0", "3", 1.0),
        ("The answer is 3.5", "3", 0.0),
        ("x = -5", "-5", 1.0),
        ("10-4 = 6", "6", 1.0),
        ("We get 18\n#### 18\nThanks, 3 more", "18", 1.0),  # the #### line wins over the last number
        ("I don't know", "5", 0.0),
        ("", "5", 0.0),
        ("so 72", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", 1.0),  # raw gsm8k answer as label
        ("so 1000 clips", "1,000", 1.0),
    ],
)
def test_gsm8k_reward(response, label, reward):
    assert gsm8k_reward(response, label) == reward


def test_gsm8k_label_without_number_is_an_error():
    with pytest.raises(ValueError, match="holds no number"):
        gsm8k_reward("5", "five")


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("Let me think.\nAnswer: 33", "33", 1.0),
        ("Answer: 33", "34", -1.0),
        ("no answer line, just 33", "33", -1.0),
        ("answer: 12\n...wait.\nANSWER: 33", "33", 1.0),  # last line, case-insensitive
        ("Answer: $33$", "33", 1.0),
        (r"Answer: \boxed{33}", "33", 1.0),
        ("Answer: x = 33.", "33", 1.0),
        ("Answer: 033", "33", 1.0),
        ("Answer: 1,000", "1000", 1.0),
        (r"Answer: \frac{1}{2}", r"\dfrac{1}{2}", 1.0),
        # DAPO reads only the last 300 characters: an early answer line does not count.
        ("Answer: 33\n" + "x" * 400, "33", -1.0),
    ],
)
def test_dapo_reward(response, label, reward):
    assert dapo_reward(response, label) == reward


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        (r"<think>maybe \boxed{3}</think> The answer is \boxed{4}.", "4", 1.0),
        (r"<think>so \boxed{4}</think> The answer is \boxed{3}.", "4", 0.0),  # the boxed guess in thinking is ignored
        (r"<think>so \boxed{4}</think> The answer is 4.", "4", 0.0),
        (r"I never close my thinking \boxed{4}", "4", 0.0),
        (r"<think>a</think> b </think> \boxed{\frac{1}{2}}", "0.5", 1.0),
    ],
)
def test_deepscaler_reward(response, label, reward):
    assert deepscaler_reward(response, label) == reward


def test_builtin_names_resolve_to_their_functions():
    assert set(BUILTIN_REWARDS) == {"math", "gsm8k", "dapo", "deepscaler", "code"}
    for name, fn in BUILTIN_REWARDS.items():
        assert get_reward_fn(name) is fn
    assert get_reward_fn("gsm8k")("1 + 1 = 2", "2") == 1.0


def test_unknown_rm_type_lists_the_choices():
    with pytest.raises(ValueError, match=r"--rm-type 'maths' is unknown; choose one of math, gsm8k, dapo, deepscaler"):
        get_reward_fn("maths")


def _write(path, source):
    path.write_text(textwrap.dedent(source))
    return path


def test_custom_reward_from_a_file(tmp_path):
    file = _write(
        tmp_path / "my_reward.py",
        """
        def length_reward(response: str, label: str) -> float:
            return float(len(response) == int(label))
        """,
    )
    fn = get_reward_fn("math", custom_rm_path=f"{file}:length_reward")
    assert fn("abc", "3") == 1.0
    assert fn("abcd", "3") == 0.0


def test_custom_reward_from_a_module(tmp_path, monkeypatch):
    package = tmp_path / "team_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _write(
        package / "exact.py",
        """
        def exact(response, label):
            return 1.0 if response.strip() == label else 0.0
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("math", custom_rm_path="team_rewards.exact:exact")
    assert fn(" yes ", "yes") == 1.0
    assert fn("no", "yes") == 0.0
    assert get_reward_fn("math", custom_rm_path="team_rewards.exact.exact") is fn  # vime's dotted form
    for name in ("team_rewards.exact", "team_rewards"):
        sys.modules.pop(name, None)


def test_custom_reward_errors_name_the_flag_and_the_fix(tmp_path):
    file = _write(
        tmp_path / "bad.py",
        """
        def one_arg(response):
            return 0.0

        async def asynchronous(response, label):
            return 0.0

        NOT_A_FUNCTION = 3
        """,
    )
    broken = _write(tmp_path / "broken.py", "raise RuntimeError('boom')\n")
    cases = {
        "no_colon_here": r"--custom-rm-path 'no_colon_here': expected `package.module:function`, vime's "
                         r"`package.module.function`, or `path/to/file.py:function`",
        "no_such_package_xyz.rewards.fn": r"cannot import module 'no_such_package_xyz.rewards'",  # vime's form
        f"{tmp_path}/missing.py:fn": r"file '.*missing.py' does not exist",
        f"{file}:absent": r"has no function 'absent'; define `def absent\(response: str, label: str\) -> float`",
        f"{file}:one_arg": r"cannot be called with \(response, label\)",
        f"{file}:asynchronous": r"is in vime's form `async \(args, sample\) -> float`; this use grades text alone",
        f"{file}:NOT_A_FUNCTION": r"3 is not callable",
        f"{broken}:fn": r"executing '.*broken.py' failed: RuntimeError\('boom'\)",
        "no_such_package_xyz.rewards:fn": r"cannot import module 'no_such_package_xyz.rewards'",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message) as info:
            get_reward_fn("math", custom_rm_path=spec)
        assert str(info.value).startswith(f"--custom-rm-path {spec!r}")
