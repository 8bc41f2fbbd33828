"""AIME-style evaluation: n samples per problem, avg@n and pass@k, and a per-problem results file."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from vime_engine.sample import Sample, SampleStatus


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which avoids huge binomials; exactly 1.0 when n - c < k
    (every draw of k samples contains a correct one). Requires 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def ks_for(n: int) -> list[int]:
    """The k values reported for n samples: powers of two up to n, and n itself."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def summarize(name: str, samples: list[Sample], n: int, correct_threshold: float = 1.0) -> tuple[dict[str, float], list[dict]]:
    """Metrics `eval/NAME` (avg@n), `eval/NAME-pass@k`, lengths and truncation; and one row per problem."""
    by_problem: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        by_problem[s.group_index].append(s)
    rows, pass_values = [], defaultdict(list)
    for group_index in sorted(by_problem):
        group = by_problem[group_index]
        correct = [s.reward >= correct_threshold for s in group]
        for k in ks_for(len(group)):
            pass_values[k].append(pass_at_k(len(group), sum(correct), k))
        rows.append({
            "problem": group[0].prompt,
            "label": group[0].label,
            "answers": [s.response for s in group],
            "extracted": [s.metadata.get("extracted_answer") for s in group],
            "correct": correct,
            "rewards": [s.reward for s in group],
        })
    metrics = {
        f"eval/{name}": statistics.fmean(s.reward >= correct_threshold for s in samples),
        f"eval/{name}/response_len/mean": statistics.fmean(s.response_length for s in samples),
        f"eval/{name}/truncated_ratio": statistics.fmean(s.status == SampleStatus.TRUNCATED for s in samples),
    }
    for k, values in pass_values.items():
        metrics[f"eval/{name}-pass@{k}"] = statistics.fmean(values)
    return metrics, rows


def write_results(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path
