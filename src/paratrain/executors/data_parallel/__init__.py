"""DataParallel: replicas on disjoint shards, gradients combined every step (DESIGN §4).

- :mod:`.runner`: launch, the replica's set-up and its part of the one training loop;
- :mod:`.engine`: the replica's engine (one step: forward, backward, the gradient sync);
- :mod:`.aggregation`: how gradients (or parameters) are combined: AllReduce,
  ParameterServer, Decentralized gossip, with or without compression;
- ZeRO (``strategy.shard``: each replica steps its 1/N rows of every parameter) is
  :mod:`paratrain.executors.shared.zero`, shared with tensor and model parallelism.
"""

from __future__ import annotations

from typing import Any

from ...config.job import JobConfig
from ..shared.replicas import check_replica_rows
from ..spec import ExecutorSpec, GraphView, Traced
from .runner import run, shard_indices, shard_layout, train_replica, validate

__all__ = ["SPEC", "run", "train_replica", "shard_indices"]


def _processes(job: JobConfig) -> tuple[int, str]:
    strategy: Any = job.strategy
    return int(strategy.num_replicas), "strategy.num_replicas"


def _describe(job: JobConfig) -> list[str]:
    """``paratrain validate``'s lines: what ZeRO (``strategy.shard``) shards."""
    strategy: Any = job.strategy
    return shard_layout(job) if strategy.shard != "none" else []


def _graph(traced: Traced) -> GraphView:
    """``paratrain graph``'s ``shard`` section: ZeRO's units over the traced model."""
    s: Any = traced.job.strategy
    if s.shard == "none":
        return GraphView()

    def sections() -> dict[str, Any]:
        from ...subgraphs import local_parameter_names
        from ..shared.zero_plan import shard_plan

        return {"shard": shard_plan(traced.model, level=s.shard, units=s.shard_unit, world=s.num_replicas,
                                    local=local_parameter_names(traced.model, traced.job))}

    return GraphView(sections)


SPEC = ExecutorSpec(name="DataParallel", run=run, processes=_processes, validate=validate,
                    check_data=check_replica_rows, describe=_describe, graph=_graph)
