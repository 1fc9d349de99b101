"""Tensor parallelism (Megatron-style) as an executor: Local or DataParallel jobs with
``tensor_parallel_size > 1`` (DESIGN §6); the sharding itself is :mod:`paratrain.tensor_parallel`."""

from __future__ import annotations

from typing import Any

from ...config.job import JobConfig
from ..shared.replicas import check_replica_rows
from ..spec import ExecutorSpec, GraphView, Traced
from .ignored import ignores
from .runner import dry_run, mesh_lines, mesh_plan, run

__all__ = ["SPEC", "run"]


def _processes(job: JobConfig) -> tuple[int, str]:
    """``tensor_parallel_size`` x DataParallel replicas (one for Local)."""
    strategy: Any = job.strategy
    tp = job.tensor_parallel.tensor_parallel_size if job.tensor_parallel else 1
    dp = int(strategy.num_replicas) if strategy.type == "DataParallel" else 1
    return tp * dp, "tensor_parallel.tensor_parallel_size"


def _describe(job: JobConfig) -> list[str]:
    """``paratrain validate``'s lines: which modules are sharded and how (the dry run), and a
    DataParallel job's dp x tp mesh (with ZeRO over its dp columns)."""
    lines = [f"tensor parallel: {p}: {how}" for p, how in dry_run(job)]
    if job.strategy.type == "DataParallel":
        lines += mesh_lines(job)
    return lines


def _graph(traced: Traced) -> GraphView:
    """``paratrain graph``'s sections: the modules sharded and how, the mesh (ZeRO's units)."""
    job = traced.job

    def sections() -> dict[str, Any]:
        tp: Any = job.tensor_parallel
        out: dict[str, Any] = {"tensor_parallel_size": tp.tensor_parallel_size,
                               "tensor_parallel": [{"module": p, "sharding": how} for p, how in dry_run(job)]}
        mesh = mesh_plan(job)  # the dp x tp mesh; ZeRO runs over its dp columns
        if "shard" in mesh:
            out["shard"] = mesh.pop("shard")
        out["mesh"] = mesh
        return out

    return GraphView(sections)


SPEC = ExecutorSpec(name="TensorParallel", run=run, processes=_processes, validate=dry_run,
                    check_data=check_replica_rows, ignores=ignores, describe=_describe, graph=_graph)
