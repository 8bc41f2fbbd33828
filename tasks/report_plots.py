"""PNG plots of a run's metrics history (matplotlib, headless): one figure per quantity the report shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# file name → (title, metric keys, y label)
PLOTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "reward.png": ("Rollout reward", ("rollout/raw_reward",), "mean reward"),
    "logprob_diff.png": ("Train vs rollout log-prob difference", ("train/train_rollout_logprob_abs_diff",),
                         "mean |Δ log p|"),
    "response_length.png": ("Response length", ("rollout/response_len/mean",), "tokens"),
}


def eval_keys(history: list[dict[str, Any]]) -> list[str]:
    """`eval/NAME` and `eval/NAME-pass@k` keys present in the history (not lengths or truncation ratios)."""
    return sorted({k for r in history for k in r if k.startswith("eval/") and "/" not in k[5:]})


def series(history: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(rollout ids, values) of every record that has `key`; evaluation at id -1 is before any training."""
    points = [(int(r["rollout_id"]), float(r[key])) for r in history if isinstance(r.get(key), (int, float))]
    points.sort()
    return [p[0] for p in points], [p[1] for p in points]


def write_plots(history: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write every plot that has data; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    plots = dict(PLOTS)
    if keys := eval_keys(history):
        plots["eval_scores.png"] = ("Evaluation (avg@n, pass@k)", tuple(keys), "score")
    written = []
    for name, (title, keys, ylabel) in plots.items():
        lines = [(k, *series(history, k)) for k in keys]
        if not any(xs for _, xs, _ in lines):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        for key, xs, ys in lines:
            ax.plot(xs, ys, marker="o", markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("rollout (−1 = before training)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        written.append(out_dir / name)
    return written
