"""MLflow: the run's metrics at step = rollout id, the flat config as the run's params.

Runs are found again by the tag `vime.run_key` in the experiment (or given by `--mlflow-run-id`). Metric
names keep vime's, except for characters MLflow refuses: `eval/NAME-pass@k` is logged as
`eval/NAME-pass_at_k`. Params cannot change once logged: a resumed run adds the ones the run lacks and keeps
the first values of the others (a warning names those that differ, e.g. a new `--load` path).
The default store is SQLite under --output-dir; mlflow-skinny's file store (`./mlruns`) is retired upstream.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from vime_engine.config import ConfigError, LoggingConfig
from vime_engine.tracking.resume import DEFAULT_PROJECT, HeldSteps

log = logging.getLogger(__name__)
RUN_KEY_TAG = "vime.run_key"


def default_tracking_uri(output_dir: str) -> str:
    return f"sqlite:///{(Path(output_dir) / 'mlflow.db').resolve()}"


def mlflow_name(key: str) -> str:
    """A vime metric name as MLflow accepts it: word characters, / . - : and spaces."""
    return re.sub(r"[^/\w.\- :]", "_", key.replace("@", "_at_"))


class MlflowTracker:
    def __init__(self, lg: LoggingConfig, run_key: str, config: dict[str, Any]):
        self.uri = lg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(
            lg.output_dir)
        Path(lg.output_dir).mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri)
        if lg.mlflow_run_id is not None:
            self.run_id = self._existing_run(lg.mlflow_run_id)
        else:
            self.run_id = self._run_for_key(lg.mlflow_experiment_name or DEFAULT_PROJECT, run_key)
        self.client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        self.held = HeldSteps(self._held())
        self._log_params(config)
        log.info("MLflow run %s at %s", self.run_id, self.uri)

    def _existing_run(self, run_id: str) -> str:
        try:
            return self.client.get_run(run_id).info.run_id
        except MlflowException as exc:
            raise ConfigError(
                f"--mlflow-run-id {run_id}: no such run at {self.uri} ({exc.message}); leave the flag out to "
                "create a run"
            ) from None

    def _run_for_key(self, experiment_name: str, run_key: str) -> str:
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'")
        if found:
            return found[0].info.run_id
        return self.client.create_run(experiment_id, tags={RUN_KEY_TAG: run_key}).info.run_id

    def _held(self) -> dict[str, int]:
        names = self.client.get_run(self.run_id).data.metrics
        return {name: max(m.step for m in self.client.get_metric_history(self.run_id, name)) for name in names}

    def _log_params(self, config: dict[str, Any]) -> None:
        params = {key: _param_value(value) for key, value in config.items()}
        logged = self.client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            log.warning("MLflow run %s keeps its first values of %s (MLflow params cannot change)",
                        self.run_id, ", ".join(changed))
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        for start in range(0, len(new), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=new[start:start + MAX_PARAMS_TAGS_PER_BATCH])

    def log(self, rollout_id: int, metrics: dict[str, float]) -> None:
        named = {mlflow_name(k): v for k, v in metrics.items()}
        now = int(time.time() * 1000)
        fresh = [Metric(k, v, now, rollout_id) for k, v in self.held.new(rollout_id, named).items()]
        for start in range(0, len(fresh), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=fresh[start:start + MAX_METRICS_PER_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _param_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MAX_PARAM_VAL_LENGTH else text[:MAX_PARAM_VAL_LENGTH - 1] + "…"
