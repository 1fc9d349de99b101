"""ModelParallel: the model's nodes placed on worker processes, pipelined (DESIGN §5).

- :mod:`.plan`: which nodes run on which stage (a pure function of the job);
- :mod:`.schedule`: GPipe / 1F1B / Interleaved1F1B / ZBH1 micro-batch orders (pure);
- :mod:`.backward_split`: a backward split into input (B) and weight (W) gradients (ZBH1);
- :mod:`.runtime`: one stage's forward/backward with point-to-point activations;
- :mod:`.engine`: the stage's part of the one training loop (engine, checkpoints, stats);
- :mod:`.validation`: a job's worker count and placement, checked before any launch;
- :mod:`.runner`: launch and a rank's run (``worker_main``);
- :mod:`.graph_view`: what ``paratrain graph`` shows of the placement (``SPEC.graph``).
"""

from __future__ import annotations

from ...config.job import JobConfig
from ..spec import ExecutorSpec
from .graph_view import PlacementView
from .runner import run
from .validation import check_worker_ids, num_workers, validate

__all__ = ["SPEC", "run"]


def _processes(job: JobConfig) -> tuple[int, str]:
    check_worker_ids(job)  # an implicit world is only counted once its WorkerIds are known good
    field = ("workers" if job.workers else "run.num_workers" if job.run.num_workers
             else "strategy.partitions")
    tp = job.tensor_parallel.tensor_parallel_size if job.tensor_parallel else 1
    if tp > 1:  # pipeline x tensor parallel: tp processes per stage (.tp_stages)
        return num_workers(job) * tp, "tensor_parallel.tensor_parallel_size"
    return num_workers(job), field


SPEC = ExecutorSpec(name="ModelParallel", run=run, processes=_processes, validate=validate,
                    graph=PlacementView)
