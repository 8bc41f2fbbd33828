"""The console's pieces: the live view's ETA, the engine output redirected to a file, the failing worker's last
lines, the one-line summary of an engine failure, the report's plots inline for the Prefect UI."""

from __future__ import annotations

import os
import subprocess
import sys

from rich.console import Console

from flows.console_view import LiveView, engine_warnings_on, failing_pid, log_tail, output_to_file
from tasks.engine_job.process import EngineCodeFailure
from tasks.publish import embed_plots


def test_output_to_file_sends_every_writer_to_the_log_and_keeps_a_terminal_console(tmp_path, capfd):
    log = tmp_path / "logs" / "engine.log"
    with output_to_file(log) as screen:
        print("from python", file=sys.__stdout__, flush=True)  # pytest's capture replaces sys.stdout
        os.write(2, b"from a C library\n")
        subprocess.run([sys.executable, "-c", "print('from a child process')"], check=True)
        screen.print("live view")
    os.write(1, b"after\n")
    captured = capfd.readouterr()
    assert log.read_text().splitlines() == ["from python", "from a C library", "from a child process"]
    assert captured.out.splitlines() == ["live view", "after"] and captured.err == ""


def test_the_engines_warnings_reach_the_terminal_while_its_output_goes_to_a_file(tmp_path, capfd):
    import logging

    log = tmp_path / "engine.log"
    with output_to_file(log) as screen, engine_warnings_on(screen):
        logging.getLogger("vime_engine.runtime.run_state").warning("skipping checkpoint %s: corrupt", "rollout_3")
        logging.getLogger("vime_engine.runtime.run_state").info("resuming from rollout_2")
        logging.getLogger("ray").warning("a Ray notice")
    terminal = capfd.readouterr().out
    assert "skipping checkpoint rollout_3: corrupt" in terminal
    assert "resuming" not in terminal and "Ray notice" not in terminal


def test_log_tail_keeps_the_failing_workers_lines_without_colours(tmp_path):
    log = tmp_path / "engine.log"
    lines = [f"\x1b[36m(TrainerRank pid=7)\x1b[0m step {i}" for i in range(20)]
    lines += ["\x1b[36m(RolloutActor pid=70)\x1b[0m generating", "driver line"]
    log.write_text("\n".join(lines) + "\n")
    assert log_tail(log, pid=7, lines=2) == ["(TrainerRank pid=7) step 18", "(TrainerRank pid=7) step 19"]
    assert log_tail(log, lines=2) == ["(RolloutActor pid=70) generating", "driver line"]
    assert log_tail(log, pid=12345, lines=1) == ["driver line"]  # no line of that worker: the log's last
    assert log_tail(tmp_path / "missing.log") == []


def test_an_engine_failure_reads_as_its_last_line_and_names_the_worker():
    traceback = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                 "ray.exceptions.RayTaskError(ValueError): ray::TrainerRank.train() (pid=4242, ip=127.0.0.1)\n"
                 "ValueError: values must be flat\n(engine log: /w/logs/chunk-0000000.log)")
    failure = EngineCodeFailure(traceback)
    assert failure.summary == "ValueError: values must be flat"
    assert failing_pid(failure) == 4242 and failing_pid(ValueError("no worker")) is None


def test_embed_plots_inlines_each_plot_as_a_data_uri(tmp_path):
    (tmp_path / "reward.png").write_bytes(b"\x89PNG\r\n\x1a\nfake")
    report = "## Plots\n\n![reward.png](plots/reward.png)\n"
    assert embed_plots(report, tmp_path, ["reward.png"]) == (
        "## Plots\n\n![reward.png](data:image/png;base64,iVBORw0KGgpmYWtl)\n")


def test_the_run_summary_puts_an_evaluation_before_and_after_on_one_line():
    from flows.cli import _summary_lines

    lines = _summary_lines({"reward_first": 0.125, "step_time_mean": None, "eval/aime before": 0.0,
                            "eval/aime final": 0.25, "eval/held-out final": 0.5})
    assert [line.split() for line in lines] == [["reward_first", "0.125"], ["step_time_mean", "—"],
                                                ["eval/aime", "0", "→", "0.25"], ["eval/held-out", "final", "0.5"]]


def test_the_live_view_gives_an_eta_when_rollouts_are_minutes_apart():
    now = [0.0]
    screen = Console(width=200, record=True, force_terminal=False)
    view = LiveView(screen, total_rollouts=12, stage="train_chunk", clock=lambda: now[0])
    for rollout_id in range(4):  # one rollout every 90 s: far apart, as on a CPU
        now[0] += 90.0
        view.rollout(rollout_id, {"rollout/raw_reward": 0.5}, chunk="chunk 1/3")
    task = view.progress.tasks[0]
    assert task.time_remaining == 8 * 90.0  # 8 rollouts left at one a 90 s
    screen.print(view.progress)
    assert "0:12:00" in screen.export_text()
