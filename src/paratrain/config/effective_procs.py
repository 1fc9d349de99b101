"""Which process settings (``run.max_restarts``/``num_workers``/``backend``, ``[[workers]]``,
``[comm]``) a strategy reads, and why the others are ignored.

Kept apart from :mod:`.effective` (which calls :func:`ignored_process_settings`) because
the rules are about processes, not about the model: a run trains either in this process
(Local without tensor parallelism: no elastic agent, no process group, no placement) or
on launched workers whose count each strategy decides itself:

- ``run.max_restarts``, ``run.backend``, ``comm.timeout_s``: read by every launched run
  (the elastic agent, the process group, its store and the rendezvous); a plain Local run
  has none of them.
- ``[[workers]]``: ids and tags for placement (ModelParallel targets, Federated
  ByCapability, worker ids in logs); a plain Local run has one process and places nothing.
- ``run.num_workers``: the process count of ModelParallel, Federated and PopulationBased;
  Local runs one process, DataParallel ``strategy.num_replicas`` and tensor parallelism
  ``tensor_parallel_size`` x replicas.
- ``comm.bucket_size_mb``: DataParallel's AllReduce without compression (the bucketed
  gradient all-reduce) and a ModelParallel replicated stage (``[subgraphs.<path>] type =
  "DataParallel"``, whose replicas sum their gradients through the same sync);
  ``comm.gossip_step``: DataParallel's Decentralized with compression (CHOCO-gossip). No
  other strategy or aggregation reads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .job import JobConfig

__all__ = ["ignored_process_settings"]


def ignored_process_settings(job: JobConfig, *, kind: str, tp_active: bool) -> list[tuple[str, str]]:
    """``(field, reason)`` for each process setting ``job`` sets that its run ignores.

    ``kind`` is the strategy type, ``tp_active`` whether the job runs on the tensor-parallel
    executor. Custom reads the whole job: nothing is reported for it."""
    from ._base import is_set as _set

    if kind == "Custom":
        return []
    run, comm, s = job.run, job.comm, job.strategy
    in_process = kind == "Local" and not tp_active
    out: list[tuple[str, str]] = []
    if in_process:
        local = "a Local run trains in this one process"
        for name, why in (
            ("max_restarts", "there are no worker processes for an elastic agent to restart"),
            ("num_workers", "it starts no worker processes"),
            ("backend", "it joins no torch.distributed process group"),
        ):
            if _set(run, name):
                out.append((f"run.{name}", f"{local}: {why}"))
        if job.workers:
            out.append(("workers", f"{local}: there is nothing to place on workers"))
        if _set(comm, "timeout_s"):
            out.append(("comm.timeout_s", f"{local}: it has no process group, store or "
                                           "rendezvous to time out"))
    elif _set(run, "num_workers") and (kind == "DataParallel" or tp_active):
        count = ("tensor_parallel_size x strategy.num_replicas (tensor parallelism)" if tp_active
                 else "strategy.num_replicas")
        out.append(("run.num_workers", f"{kind} starts {count} processes"))

    method = getattr(getattr(s, "aggregation", None), "method", None)
    dp = kind == "DataParallel" and not tp_active
    compressed = job.compression is not None and job.compression.method != "None"
    where = ("the tensor-parallel executor reduces gradients its own way" if tp_active
             else f"{kind} has no DataParallel gradient exchange")
    replicated = kind == "ModelParallel" and any(
        getattr(sub, "type", None) == "DataParallel" for sub in (job.subgraphs or {}).values())
    # the replicated stage's gradient sum is bucketed as DataParallel's AllReduce
    buckets = (dp and method == "AllReduce" and not compressed) or replicated
    if _set(comm, "bucket_size_mb") and not buckets:
        why = (f"only DataParallel's AllReduce without compression buckets gradients; this job "
               f"runs {method}{' with compression' if compressed else ''}" if dp else where)
        out.append(("comm.bucket_size_mb", why))
    if _set(comm, "gossip_step") and not (dp and method == "Decentralized" and compressed):
        why = ("it applies to DataParallel's Decentralized aggregation with compression "
               f"(CHOCO-gossip); this job runs {method}{' with compression' if compressed else ''}"
               if dp else where)
        out.append(("comm.gossip_step", why))
    return out
