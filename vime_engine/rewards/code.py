"""`--rm-type code`: the response's Python, run against the label's tests in the sandbox (`sandbox.py`).

The code is the response's last fenced block tagged python / py / python3 or untagged; the label is Python
test code run after it in the same namespace (e.g. `assert add(2, 3) == 5`). 1.0 when both run without an
exception within the limits, else 0.0: no code block, a failed assertion, an error, a limit hit, or an attempt
to reach outside the sandbox (network, files outside its directory, other programs) all score 0.
"""

from __future__ import annotations

import re

from vime_engine.rewards.sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3"}
LIMITS = SandboxLimits()


def extract_code(response: str) -> str | None:
    """The last fenced code block of `response` tagged as Python (or untagged); None when there is none."""
    blocks = [body for tag, body in _FENCE.findall(response) if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else None


def code_reward(response: str, label: str) -> float:
    code = extract_code(response)
    if code is None or not code.strip():
        return 0.0
    return 1.0 if run_python(code, label, LIMITS).passed else 0.0
