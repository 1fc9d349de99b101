"""Tensor parallelism (Megatron-style) as an executor: Local or DataParallel jobs with
``tensor_parallel_size > 1`` (DESIGN §6). The sharding itself is :mod:`paratrain.tensor_parallel`.

- :mod:`.runner`: launch, the TP(×DP) grid set-up and its part of the one training loop.
"""

from __future__ import annotations

from typing import Any

from ...config.job import JobConfig
from ..spec import ExecutorSpec
from .ignored import ignores
from .runner import run, validate, worker_main

__all__ = ["SPEC", "run", "worker_main"]


def _processes(job: JobConfig) -> tuple[int, str]:
    """``tensor_parallel_size`` x DataParallel replicas (one for Local)."""
    strategy: Any = job.strategy
    tp = job.tensor_parallel.tensor_parallel_size if job.tensor_parallel else 1
    dp = int(strategy.num_replicas) if strategy.type == "DataParallel" else 1
    return tp * dp, "tensor_parallel.tensor_parallel_size"


SPEC = ExecutorSpec(name="TensorParallel", run=run, worker=worker_main, processes=_processes,
                    validate=validate, ignores=ignores)
