"""DataParallel: replicas on disjoint shards, gradients combined every step (DESIGN §4).

- :mod:`.runner`: launch, the replica's set-up and its part of the one training loop;
- :mod:`.engine`: the replica's engine (one step: forward, backward, the gradient sync);
- :mod:`.aggregation`: how gradients (or parameters) are combined: AllReduce,
  ParameterServer, Decentralized gossip, with or without compression;
- :mod:`.zero`, :mod:`.zero_plan`, :mod:`.zero_shards`: ZeRO (``strategy.shard``): each replica steps its 1/N
  rows of every parameter (optimizer state, gradients, parameters sharded by level).
"""

from __future__ import annotations

from typing import Any

from ...config.job import JobConfig
from ..spec import ExecutorSpec
from .runner import run, shard_indices, train_replica, validate, worker_main

__all__ = ["SPEC", "run", "worker_main", "train_replica", "shard_indices"]


def _processes(job: JobConfig) -> tuple[int, str]:
    strategy: Any = job.strategy
    return int(strategy.num_replicas), "strategy.num_replicas"


SPEC = ExecutorSpec(name="DataParallel", run=run, worker=worker_main, processes=_processes,
                    validate=validate)
