"""What a step of data-parallel replicas takes from the training set (DataParallel, and
tensor parallelism with or without DataParallel replicas): :func:`check_replica_rows`,
their ``ExecutorSpec.check_data``."""

from __future__ import annotations

from typing import Any

from ...config import ConfigError
from ...config.job import JobConfig
from ...data.loader import is_stream

__all__ = ["check_replica_rows"]


def check_replica_rows(job: JobConfig, bundle: Any) -> None:
    """ConfigError unless replicas x ``train.batch_size`` rows fit in ``bundle.train`` (a
    stream's rows are not counted: :func:`paratrain.task.preflight_task`)."""
    if is_stream(bundle.train):
        return
    s: Any = job.strategy
    rows = len(bundle.train)
    replicas = int(s.num_replicas) if s.type == "DataParallel" else 1
    need = replicas * job.train.batch_size
    if rows < need:
        raise ConfigError([("strategy.num_replicas" if replicas > 1 else "train.batch_size", (
            f"{replicas} replica(s) x train.batch_size {job.train.batch_size} = {need} rows per step, "
            f"but the training set has {rows} rows; lower num_replicas or batch_size"))])
