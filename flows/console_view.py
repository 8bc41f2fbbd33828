"""What `vimeflow run` and `vimeflow train` show on the console: one live view of the run, the engine's output
in log files.

The engine's output (Ray, the trainer ranks, the vLLM engines) goes to files: for `run`, tasks.engine_job.process
sends each engine job's output to `<work dir>/logs/`; for `train`, the command's own stdout and stderr
descriptors point at `<output dir>/logs/engine.log` while the engine runs (Ray forwards every worker's output to
its driver, which is this process), and the live view writes to the terminal's descriptors. `--verbose` keeps
today's streams. Progress bars that only add noise are turned off where they are made (QUIET_ENVIRONMENT).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)

# Set unless the user set them: noise turned off at its source, for this process and every child (the engine
# process, Ray workers) that inherits the environment.
QUIET_ENVIRONMENT = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' / huggingface_hub's bars: model writes, weight loads
    "TQDM_DISABLE": "1",  # plain tqdm bars, e.g. transformers' GGUF de-quantizing when the built-in model is made
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # the ephemeral server's telemetry: an ERROR line when offline
    # vLLM's triton dispatcher touches a deprecated torch attribute at import, twice per engine process
    "PYTHONWARNINGS": "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",
}
TAIL_LINES = 12


def quiet_environment() -> None:
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def rollout_fields(m: dict[str, Any]) -> str:
    """The numbers of one rollout's metrics record, as the live view shows them."""
    return (f"reward {m.get('rollout/raw_reward', 0):.3f}  len {m.get('rollout/response_len/mean', 0):.1f}  "
            f"Δlogp {m.get('train/train_rollout_logprob_abs_diff', 0):.1e}  "
            f"gen {m.get('perf/rollout_time', 0):.1f}s  train {m.get('perf/train_time', 0):.1f}s")


class LiveView:
    """One progress bar over the run's rollouts: the stage, the chunk, the latest rollout's numbers, the time
    spent and the time left."""

    def __init__(self, console: Console, total_rollouts: int, stage: str, clock: Callable[[], float] | None = None):
        self.progress = Progress(
            TextColumn("[bold]{task.fields[stage]}"), TextColumn("{task.fields[chunk]}"), BarColumn(),
            MofNCompleteColumn(), TextColumn("{task.fields[latest]}"), TimeElapsedColumn(), TextColumn("ETA"),
            TimeRemainingColumn(), console=console, get_time=clock,
            # The rate over the whole run: rich's default window (30 s) holds at most one rollout of a real run,
            # and with one sample it has no rate, so the ETA stayed blank.
            speed_estimate_period=float("inf"),
        )
        self.task = self.progress.add_task("rollouts", total=total_rollouts, stage=stage, chunk="", latest="")

    def __enter__(self) -> LiveView:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def stage(self, name: str) -> None:
        self.progress.update(self.task, stage=name)

    def rollout(self, rollout_id: int, metrics: dict[str, Any], chunk: str = "") -> None:
        self.progress.update(self.task, completed=rollout_id + 1, latest=rollout_fields(metrics), chunk=chunk)


class PipelineFollower(logging.Handler):
    """Feeds the live view from the pipeline's Prefect log records (the flow runs in this process): the stage
    from the task that logs, the rollouts from the metrics record train_chunk attaches to each rollout's line.
    While it follows, Prefect's console handlers leave those rollout lines to the live view and print through
    it; the lines still reach the Prefect API, so the UI keeps one line per rollout."""

    def __init__(self, view: LiveView, rollouts_per_chunk: int, chunks: int):
        super().__init__()
        from tasks.train_chunk import ROLLOUT_RECORD

        self.view, self.per_chunk, self.chunks, self.record_attr = view, rollouts_per_chunk, chunks, ROLLOUT_RECORD
        self.consoles: list[tuple[Console, TextIO]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if task := getattr(record, "task_name", None):
            self.view.stage(task)
        metrics = getattr(record, self.record_attr, None)
        if metrics and "rollout/raw_reward" in metrics:
            chunk = int(metrics["chunk_start"]) // self.per_chunk + 1
            self.view.rollout(int(metrics["rollout_id"]), metrics, f"chunk {chunk}/{self.chunks}")

    def _not_a_rollout(self, record: logging.LogRecord) -> bool:
        return not hasattr(record, self.record_attr)

    @contextlib.contextmanager
    def following(self) -> Iterator[None]:
        from prefect.logging.handlers import PrefectConsoleHandler

        prefect_logger = logging.getLogger("prefect")
        handlers = {h for lg in _loggers() for h in lg.handlers if isinstance(h, PrefectConsoleHandler)}
        prefect_logger.addHandler(self)
        with self.view:
            for handler in handlers:
                handler.addFilter(self._not_a_rollout)
                # sys.stderr is now the live display's proxy (on a terminal): lines print above the bar
                self.consoles.append((handler.console, handler.console.file))
                handler.console.file = sys.stderr
            try:
                yield
            finally:
                for handler in handlers:
                    handler.removeFilter(self._not_a_rollout)
                for console, file in self.consoles:
                    console.file = file
                prefect_logger.removeHandler(self)


def _loggers() -> list[logging.Logger]:
    return [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                   if isinstance(lg, logging.Logger))]


class _ConsoleHandler(logging.Handler):
    def __init__(self, console: Console):
        super().__init__(logging.WARNING)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        self.console.print(f"{record.levelname.lower()}: {record.getMessage()}", style="yellow", soft_wrap=True,
                           highlight=False, markup=False)


@contextlib.contextmanager
def engine_warnings_on(console: Console) -> Iterator[None]:
    """The engine's own warnings in this process (a corrupt checkpoint skipped, prompts dropped for length, an
    engine restarted) on the terminal too, above the live view, while the rest of the output goes to the log."""
    handler = _ConsoleHandler(console)
    engine_logger = logging.getLogger("vime_engine")
    engine_logger.addHandler(handler)
    try:
        yield
    finally:
        engine_logger.removeHandler(handler)


@contextlib.contextmanager
def output_to_file(log_file: Path) -> Iterator[Console]:
    """Point this process's stdout and stderr descriptors (and so every child's and Ray's forwarded worker
    output) at `log_file` for the block; yields a console that still writes to the terminal."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    with log_file.open("a") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    with os.fdopen(os.dup(saved_out), "w", buffering=1) as terminal:
        try:
            yield Console(file=terminal)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)


def log_tail(log_file: Path, pid: int | None = None, lines: int = TAIL_LINES) -> list[str]:
    """The last lines of an engine log; with `pid`, of that worker's lines (Ray prefixes them `(Name pid=N)`)
    when it has any."""
    if not log_file.is_file():
        return []
    text = log_file.read_text(errors="replace").splitlines()
    if pid is not None:
        own = [line for line in text if f" pid={pid})" in line]
        text = own or text
    return [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in text[-lines:]]


def failing_pid(exc: BaseException) -> int | None:
    """The worker process a Ray task error came from: its `pid`, or the `(pid=N, …)` its traceback text names
    (an engine job's failure carries the traceback as text)."""
    pid = getattr(exc, "pid", None)
    if isinstance(pid, int):
        return pid
    found = re.search(r"\(pid=(\d+)", str(exc))
    return int(found.group(1)) if found else None
