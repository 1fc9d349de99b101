"""MLflow: a local file store, ``file:<run>/mlruns`` (``mlflow.tracking.MlflowClient``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from . import flat_config

FOLDER = "mlruns"
EXPERIMENT = "paratrain"
_BATCH = 100  # MLflow's log_batch takes at most 100 params (and 1000 metrics) per call
_PARAM_CHARS = 6000  # MLflow's longest param value


class MLflowTracker:
    """One MLflow run in the run folder's file store, the job's fields its params; ``own``
    (in ``trackers.json``) holds the id a resumed run continues."""

    def __init__(self, run_dir: Path, job: dict[str, Any], own: dict[str, Any]) -> None:
        # MLflow 3.x keeps the file store in maintenance mode behind this opt-out: it is the
        # store that needs nothing beyond mlflow-skinny and lives in the run folder
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=(Path(run_dir) / FOLDER).resolve().as_uri())
        run_id = own.get("run_id")
        if run_id is None:
            exp = self.client.get_experiment_by_name(EXPERIMENT)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(EXPERIMENT)
            run = self.client.create_run(exp_id, run_name=Path(run_dir).name)
            run_id = own["run_id"] = run.info.run_id
            self._params(run_id, job)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def _params(self, run_id: str, job: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v[:_PARAM_CHARS]) for k, v in flat_config(job)]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(run_id, params=params[i:i + _BATCH])

    def held_through(self) -> float | None:
        """The last step of any metric the run holds (MLflow writes each point as it is logged)."""
        metrics = self.client.get_run(self.run_id).data.metrics
        steps = [m.step for key in metrics for m in self.client.get_metric_history(self.run_id, key)]
        return float(max(steps, default=-1))

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
