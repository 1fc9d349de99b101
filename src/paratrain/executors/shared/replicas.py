"""What data-parallel replicas share (DataParallel's, a tensor-parallel mesh's dp columns):
the job's gradient compressor and the check that a step of replicas has its rows."""

from __future__ import annotations

import warnings
from typing import Any

from ...config import ConfigError
from ...config.job import JobConfig
from ...data.loader import is_stream


def _without_error_feedback(strategy: Any) -> Any:
    from ...config.compression import ClippedCompression, ErrorFeedback

    if isinstance(strategy, ErrorFeedback):
        return _without_error_feedback(strategy.base_strategy)
    if isinstance(strategy, ClippedCompression):
        return strategy.model_copy(update={"base_strategy": _without_error_feedback(strategy.base_strategy)})
    return strategy


def build_compressor(job: JobConfig, aggregation: Any = None, *, warn: bool = True) -> Any:
    """The job's gradient Compressor (None without ``[compression]``); Decentralized
    aggregation drops ErrorFeedback (CHOCO-gossip compensates the error itself)."""
    if job.compression is None or job.compression.method == "None":
        return None
    from ...compression import Compressor

    strategy = job.compression
    if getattr(aggregation, "method", None) == "Decentralized":
        stripped = _without_error_feedback(strategy)
        if stripped != strategy and warn:
            # CHOCO's public copies already carry the compression error to the next
            # round; a second residual on top double-counts it and diverges.
            warnings.warn(
                "compression: ErrorFeedback has no effect with Decentralized aggregation "
                "(CHOCO-gossip compensates the compression error itself); using its base strategy",
                stacklevel=2,
            )
        strategy = stripped
    return Compressor(strategy, seed=job.run.seed)


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
