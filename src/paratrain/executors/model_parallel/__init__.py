"""ModelParallel: the model's nodes placed on worker processes, pipelined (DESIGN §4-5; its
modules: docs/layout.md)."""

from __future__ import annotations

from ...config.job import JobConfig
from ..spec import ExecutorSpec
from .graph_view import PlacementView
from .runner import run
from .tp_stages import tp_size_of
from .validation import check_worker_ids, num_workers, validate

__all__ = ["SPEC", "run"]


def _processes(job: JobConfig) -> tuple[int, str]:
    check_worker_ids(job)  # an implicit world is only counted once its WorkerIds are known good
    field = ("workers" if job.workers else "run.num_workers" if job.run.num_workers
             else "strategy.partitions")
    tp = tp_size_of(job)
    if tp > 1:  # pipeline x tensor parallel: tp processes per stage (.tp_stages)
        return num_workers(job) * tp, "tensor_parallel.tensor_parallel_size"
    return num_workers(job), field


SPEC = ExecutorSpec(name="ModelParallel", run=run, processes=_processes, validate=validate,
                    graph=PlacementView)
