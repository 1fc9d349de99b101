"""The job's gradient compressor (``[compression]``), as DataParallel replicas and a
tensor-parallel mesh's dp columns build it: :func:`build_compressor`."""

from __future__ import annotations

import warnings
from typing import Any

from ...config.job import JobConfig

__all__ = ["build_compressor"]


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
