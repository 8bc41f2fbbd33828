"""`vimeflow`: the command line. Engine commands run without Prefect; pipeline commands import it lazily."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import sys
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RL post-training of LLMs as a workflow.")
console = Console()
errors = Console(stderr=True, soft_wrap=True, highlight=False)  # soft_wrap: a long message stays one line
VERBOSE_HELP = ("stream the engine's, Ray workers' and vLLM's output to the console (else to log files), and on "
                "an error print its traceback too (else one message)")
EXIT_USER_ERROR = 2  # input the user can fix: configuration, data, model directory, checkpoint
EXIT_FAILURE = 1
EXIT_INFRASTRUCTURE = 3  # the cluster, not the input nor our code: --ray-address does not answer
DEFAULT_TRAIN_CONFIG = "train-demo.yaml"  # shipped as package data in flows/configs/
_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


@app.callback()
def _root() -> None:
    """vimeflow: RL post-training of LLMs (vLLM rollouts, torch / Megatron training) as a resumable workflow."""


def _engine_config(config: Path | None, extra: list[str]):
    from vime_engine.assets import resolve_config_assets
    from vime_engine.config import from_flat, load_yaml, parse_flags

    values = load_yaml(config) if config else {}
    values.update(parse_flags(extra))
    return from_flat(resolve_config_assets(values))


def _cause(exc: BaseException) -> BaseException:
    """The error a Ray worker raised, not Ray's wrapper around it (whose text is the remote traceback)."""
    ray_exceptions = sys.modules.get("ray.exceptions")
    while ray_exceptions is not None and isinstance(exc, ray_exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    return exc


def _is_user_error(cause: BaseException, user_errors: tuple[type[BaseException], ...] = ()) -> bool:
    """Input the user can fix: the engine's errors of that kind, and `user_errors`."""
    from pydantic import ValidationError

    from vime_engine.checkpoint.store import CheckpointError
    from vime_engine.config import ConfigError
    from vime_engine.data.datasets import DatasetError

    return isinstance(cause, (ConfigError, DatasetError, CheckpointError, ValidationError, *user_errors))


def _fail(exc: BaseException, verbose: bool, user_errors: tuple[type[BaseException], ...] = (),
          log_file: Path | None = None) -> typer.Exit:
    """End the command with one message on stderr (after the traceback with --verbose): exit 2 for input the
    user can fix (the engine's errors of that kind, and `user_errors`), 3 for a cluster that does not answer,
    1 for anything else. A failure of the
    engine names its log (`log_file`, or the one an engine job's failure carries) and shows its last lines,
    the failing worker's where the error names it."""
    import traceback

    from rich.text import Text

    from flows.console_view import failing_pid, log_tail

    cause = _cause(exc)
    message = str(cause) if verbose else getattr(cause, "summary", str(cause))  # an engine job: its last line
    if verbose:
        errors.print("".join(traceback.format_exception(exc)), markup=False, end="")
    if _is_user_error(cause, user_errors):
        errors.print(Text("error: ", style="bold red") + Text(message))
        return typer.Exit(EXIT_USER_ERROR)
    from vime_engine.runtime.cluster import ClusterUnreachable

    if isinstance(cause, ClusterUnreachable):
        errors.print(Text("error: ", style="bold red") + Text(message))
        return typer.Exit(EXIT_INFRASTRUCTURE)
    errors.print(Text("error: ", style="bold red") + Text(f"{type(cause).__name__}: {message}"))
    log_file = log_file or getattr(cause, "log_file", None)
    if log_file is not None:
        errors.print(Text(f"last lines of {log_file}:"))
        for line in log_tail(Path(log_file), failing_pid(exc) or failing_pid(cause)):
            errors.print(Text(f"  {line}"))
    if not verbose:
        errors.print("run again with --verbose for the traceback")
    return typer.Exit(EXIT_FAILURE)


class _WithoutTraceback(logging.Formatter):
    """Formats a record as `inner` does, leaving out its traceback."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def _console_logs_without_tracebacks() -> None:
    """Prefect prints the traceback of every failed task and flow on the console; without --verbose the console
    keeps their one-line log (the tracebacks still reach the Prefect API, so the UI shows them)."""
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    for handler in {h for lg in loggers for h in lg.handlers if isinstance(h, PrefectConsoleHandler)}:
        if handler.formatter is not None and not isinstance(handler.formatter, _WithoutTraceback):
            handler.setFormatter(_WithoutTraceback(handler.formatter))


def _summary(rollout_id: int, m: dict) -> str:
    parts = [f"rollout {rollout_id:>4}", f"reward {m['rollout/raw_reward']:.3f}",
             f"len {m['rollout/response_len/mean']:.1f}", f"kl {m.get('train/ppo_kl', 0):.2e}",
             f"Δlogp {m.get('train/train_rollout_logprob_abs_diff', 0):.1e}",
             f"gen {m['perf/rollout_time']:.1f}s train {m['perf/train_time']:.1f}s "
             f"sync {m['perf/update_weights_time']:.2f}s"]
    parts += [f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items() if k.startswith("eval/") and "/" not in k[5:]]
    return " | ".join(parts)


def _summary_lines(summary: dict[str, float | None]) -> list[str]:
    """The run's summary, a line a quantity; an evaluation's `before` and `final` share one (before → final)."""
    def fmt(value: float | None) -> str:
        return "—" if value is None else f"{value:.4g}"

    lines = []
    for key, value in summary.items():
        if key.endswith(" final") and f"{key.removesuffix(' final')} before" in summary:
            continue  # shown on its `before` line
        if key.endswith(" before") and (final := f"{key.removesuffix(' before')} final") in summary:
            lines.append(f"  {key.removesuffix(' before'):<32} {fmt(value)} → {fmt(summary[final])}")
        else:
            lines.append(f"  {key:<32} {fmt(value)}")
    return lines


def _train_help(ctx: typer.Context, asked: bool) -> None:
    """The command's own options, then every engine flag from the config's schema (vime_engine/config/reference.py)."""
    if not asked or ctx.resilient_parsing:
        return
    from vime_engine.config.reference import render_reference

    typer.echo(ctx.get_help())
    typer.echo("\nEngine flags (vime's names; a YAML file given by --config takes the same names, flags win):\n")
    typer.echo(render_reference(), nl=False)
    raise typer.Exit()


@app.command(context_settings={**_PASS_THROUGH, "help_option_names": []})
def train(
    ctx: typer.Context,
    config: Path = typer.Option(None, "--config", help="YAML of vime flags (default: configs/train-demo.yaml)"),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
    _help: bool = typer.Option(False, "--help", "-h", is_eager=True, expose_value=False, callback=_train_help,
                               help="show this message and every engine flag, then exit"),
) -> None:
    """Run GRPO-style RL with vime flags, e.g. `vimeflow train --config my.yaml --num-rollout 20`."""
    from flows.console_view import LiveView, engine_warnings_on, output_to_file, quiet_environment
    from vime_engine.runtime.cluster import keep_local_ray_on_loopback

    if not verbose:
        quiet_environment()  # before a built-in model is written and Ray starts: both read it once
    try:
        from flows.configs import config_file

        cfg = _engine_config(config or (None if ctx.args else config_file(DEFAULT_TRAIN_CONFIG)), list(ctx.args))
        from vime_engine.preflight import OUTPUT_DIR_HOLDS, check_can_make_dir

        # the engine log goes there before the preflight runs
        check_can_make_dir(Path(cfg.logging.output_dir), "--output-dir", OUTPUT_DIR_HOLDS)
    except Exception as exc:  # noqa: BLE001  (one message; the traceback only with --verbose)
        raise _fail(exc, verbose) from None
    keep_local_ray_on_loopback(cfg.placement.ray_address)  # before the driver imports Ray
    from vime_engine.runtime.driver import train as run_training
    from vime_engine.runtime.preemption import Preempted

    log_file = None if verbose else cfg.logging.log_dir / "engine.log"
    made = next((d for d in reversed(log_file.parents) if not d.exists()), None) if log_file else None
    if log_file is not None:
        console.print(f"engine and worker logs: {log_file}", soft_wrap=True, highlight=False)
    failure = None
    with contextlib.ExitStack() as stack:
        screen = stack.enter_context(output_to_file(log_file)) if log_file is not None else console
        if log_file is not None:  # with --verbose they reach stderr as they always did
            stack.enter_context(engine_warnings_on(screen))
        view = stack.enter_context(LiveView(screen, cfg.rollout.num_rollout, "training"))

        def on_rollout(rollout_id: int, metrics: dict) -> None:
            screen.print(_summary(rollout_id, metrics), highlight=False, soft_wrap=True)
            view.rollout(rollout_id, metrics)

        def say_stopped(message: str) -> None:  # a second Ctrl-C: the process exits right after
            view.progress.stop()  # shows the cursor again
            screen.print(message, style="yellow", markup=False, highlight=False, soft_wrap=True)

        try:
            result = run_training(cfg, on_rollout=on_rollout, say_stopped=say_stopped)
        except Preempted as exc:  # SIGTERM or Ctrl-C (vime_engine/runtime/preemption.py)
            screen.print(str(exc), style="yellow", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except Exception as exc:  # noqa: BLE001  (reported below, on the terminal again)
            failure = exc
    if failure is not None:
        from vime_engine.config.errors import RunStoppedError

        cause = _cause(failure)
        if made is not None and _is_user_error(cause) and not isinstance(cause, RunStoppedError):
            # refused before it started: nothing written (a run stopped later keeps its logs and metrics)
            shutil.rmtree(made, ignore_errors=True)
            log_file = None
        raise _fail(failure, verbose, log_file=log_file) from None
    console.print(f"metrics: {Path(cfg.logging.output_dir) / 'metrics.jsonl'}", soft_wrap=True, highlight=False)
    if result.checkpoint is not None:
        console.print(f"checkpoint: {result.checkpoint.path}", soft_wrap=True, highlight=False)


@app.command()
def run(
    config: Path = typer.Option(None, "--config", help="pipeline YAML (flows/params.py: model, data, engine.flags, "
                                "training, evaluation, storage, image), or an engine YAML of vime flags as "
                                "`vimeflow train --config` takes (e.g. configs/agent-demo.yaml)"),
    verbose: bool = typer.Option(False, "--verbose", help=VERBOSE_HELP),
) -> None:
    """The whole pipeline (stage → convert → train in chunks → evaluate → publish) on the embedded default or
    --config; Prefect's ephemeral API unless PREFECT_API_URL is set. Re-running resumes where it stopped."""
    from flows.params import load_params
    from tasks.storage import open_storage
    from tasks.storage.errors import PermanentStorageError

    try:
        params = load_params(config)
        # A missing bucket or refused credentials: one message now, not a failed task per stage after Prefect's start.
        open_storage(params.storage.resolved_root()).check_root()
    except Exception as exc:  # noqa: BLE001
        raise _fail(exc, verbose, (OSError, PermanentStorageError)) from None
    from flows.console_view import LiveView, PipelineFollower, quiet_environment
    from flows.rl_pipeline import chunk_ranges, rl_pipeline
    from tasks.engine_job.process import STREAM_ENGINE_OUTPUT, EngineConfigFailure
    from tasks.images import ImageCheckError
    from tasks.storage.lease import LeaseHeld

    following = contextlib.nullcontext()
    if verbose:
        os.environ[STREAM_ENGINE_OUTPUT] = "1"
    else:
        quiet_environment()
        _console_logs_without_tracebacks()
        plan = params.training
        following = PipelineFollower(LiveView(console, plan.num_rollouts, "starting"), plan.rollouts_per_chunk,
                                     len(chunk_ranges(plan.num_rollouts, plan.rollouts_per_chunk))).following()
    try:
        with following:
            outcome = rl_pipeline(**params.as_flow_kwargs())
    except Exception as exc:  # noqa: BLE001  (Prefect has logged the failed task; here one message)
        raise _fail(exc, verbose, (EngineConfigFailure, PermanentStorageError, ImageCheckError, LeaseHeld)) from None
    for line in _summary_lines(outcome.summary):
        console.print(line, highlight=False)
    console.print(f"report: [bold]{outcome.report_uri}[/bold]", soft_wrap=True, highlight=False)
    console.print(f"local copy: {Path(outcome.local_dir) / 'report.md'}", soft_wrap=True, highlight=False)


@app.command()
def deploy() -> None:
    """Apply the deployments (rl-pipeline, nightly-regression) and the crash automations to PREFECT_API_URL."""
    from flows.deploy import apply_deployments, create_automations

    apply_deployments()
    create_automations()
    console.print("deployments rl-pipeline, nightly-regression and the crash automations are applied")


@app.command()
def server(host: str = typer.Option("127.0.0.1", help="address to bind; another than loopback needs "
                                    "PREFECT_SERVER_API_AUTH_STRING=USER:PASSWORD (basic auth)"),
           port: int = 4200) -> None:
    """A Prefect server (SQLite by default; PostgreSQL via PREFECT_API_DATABASE_CONNECTION_URL), the
    deployments and automations, and a process worker; runs until Ctrl-C or SIGTERM, which stop all of it."""
    from flows.deploy import ExposedServerError, ServerProcessExited, serve

    def ready(ui: str) -> None:
        console.print(f"Prefect UI: [bold]{ui}[/bold]  (worker on pool vimeflow-process; Ctrl-C stops)")

    try:
        stopped_by = serve(host, port, on_ready=ready)
    except ExposedServerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except ServerProcessExited as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    console.print(f"{stopped_by}: the Prefect server and worker are stopped")


@app.command(name="reward-server")
def reward_server(
    host: str = typer.Option("127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)"),
    port: int = typer.Option(8000, help="port to listen on; 0 picks a free one"),
    rm_type: str = typer.Option("math", "--rm-type", help="the built-in reward to serve: math | gsm8k | dapo | "
                                "deepscaler | code"),
) -> None:
    """Serve a reward over HTTP for `--rm-type remote_rm --rm-url http://HOST:PORT/` (POST / with JSON
    {prompt, response, label, id}); runs until Ctrl-C."""
    from vime_engine.rewards import BUILTIN_REWARDS
    from vime_engine.rewards.server import serve

    if rm_type not in BUILTIN_REWARDS:
        console.print(f"[red]--rm-type {rm_type!r} cannot be served; choose one of {', '.join(BUILTIN_REWARDS)}[/red]")
        raise typer.Exit(2)
    serve(BUILTIN_REWARDS[rm_type], rm_type, host, port,
          on_ready=lambda url: console.print(f"reward server ({rm_type}) on {url}  (Ctrl-C stops)", highlight=False,
                                               soft_wrap=True))


@app.command(name="modelarts-entrypoint")
def modelarts_entrypoint(
    spec: str = typer.Option(..., "--spec", help="obs://… URI of the chunk spec the submitter wrote"),
) -> None:
    """Inside a ModelArts training job: train one chunk and commit it to OBS (tasks/modelarts/entrypoint.py).
    Exit code: 0 done, 75 preempted after a committed checkpoint, 3 infrastructure, other = failure."""
    from tasks.modelarts.entrypoint import main as run_entrypoint

    raise typer.Exit(run_entrypoint(spec))


@app.command()
def convert(
    source: str = typer.Argument(..., help="the checkpoint to convert (a directory, or builtin://NAME: an HF model)"),
    dest: Path = typer.Argument(..., help="where to write the converted checkpoint"),
    direction: str = typer.Option("hf_to_megatron", help="hf_to_megatron | megatron_to_hf"),
    megatron_to_hf_mode: str = typer.Option(
        "raw", "--megatron-to-hf-mode",
        help="raw: the engine's own mapping | bridge: Megatron-Bridge's AutoBridge (Python >= 3.12)"),
) -> None:
    """Convert HF <-> Megatron torch_dist, verified by a round trip (needs megatron-core; megatron-bridge in bridge
    mode)."""
    from vime_engine.assets import resolve_model
    from vime_engine.convert import convert_checkpoint
    from vime_engine.devices.accelerator import resolve_accelerator
    from vime_engine.preflight import (
        PreflightError,
        check_megatron_mapping,
        require_megatron,
        require_megatron_bridge,
    )

    if megatron_to_hf_mode not in ("raw", "bridge"):
        raise typer.BadParameter(f"{megatron_to_hf_mode!r}: expected raw or bridge", param_hint="--megatron-to-hf-mode")
    try:  # the install hint and a family the mode does not build, before a model is read
        require_megatron()
        if megatron_to_hf_mode == "bridge":
            require_megatron_bridge()
        source_dir = resolve_model(source)  # an HF directory or a torch_dist one; builtin:// names the first
        if direction == "hf_to_megatron":
            check_megatron_mapping(source_dir, "source", megatron_to_hf_mode)
    except PreflightError as exc:
        raise _fail(exc, verbose=False) from None
    result = convert_checkpoint(Path(source_dir), dest, direction, resolve_accelerator(), mode=megatron_to_hf_mode)
    console.print(f"converted: {result}")


def main() -> None:
    try:
        app(prog_name="vimeflow")
    finally:
        # The process ends here. Python's teardown runs a last garbage collection over every object still alive,
        # which after a `vimeflow train` (torch, transformers and Ray in the driver) took 1.4 s of a tiny run's
        # 20; it leaves frozen objects out, whose memory the OS takes back anyway. atexit handlers (Ray's,
        # logging's flush) still run.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
