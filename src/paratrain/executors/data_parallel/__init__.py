"""DataParallel: replicas on disjoint shards, gradients combined every step (DESIGN §4;
:mod:`.aggregation`); ZeRO (``strategy.shard``) is :mod:`paratrain.executors.shared.zero`."""

from __future__ import annotations

from typing import Any

from ...config.job import JobConfig
from ..shared.replicas import check_replica_rows
from ..spec import ExecutorSpec, GraphView, Traced
from .runner import run, shard_layout, validate, zero_world


def _run(job: JobConfig, *, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Plain DataParallel, or replica groups on torchft under ``[fault_tolerance]``."""
    if job.fault_tolerance is None:
        return run(job, resume=resume, overwrite=overwrite)
    from .fault_tolerance import run as run_fault_tolerant

    return run_fault_tolerant(job, resume=resume, overwrite=overwrite)


def _processes(job: JobConfig) -> tuple[int, str]:
    strategy: Any = job.strategy
    return int(strategy.num_replicas), "strategy.num_replicas"


def _graph(traced: Traced) -> GraphView:
    """``paratrain graph``'s ``shard`` section: ZeRO's units over the traced model."""
    s: Any = traced.job.strategy
    if s.shard == "none":
        return GraphView()

    def sections() -> dict[str, Any]:
        from ...subgraphs import local_parameter_names
        from ..shared.zero import shard_plan

        return {"shard": shard_plan(traced.model, level=s.shard, units=s.shard_unit, world=zero_world(traced.job),
                                    local=local_parameter_names(traced.model, traced.job))}

    return GraphView(sections)


# describe: `paratrain validate`'s line on what ZeRO shards (none without strategy.shard)
SPEC = ExecutorSpec(name="DataParallel", run=_run, processes=_processes, validate=validate,
                    check_data=check_replica_rows, describe=shard_layout, graph=_graph)
