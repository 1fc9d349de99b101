"""Worker functions for the comm/DataParallel multi-process tests (module-level, importable)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.context import WorkerContext
from paratrain.config import ConfigError
from paratrain.config.job import JobConfig


def launch_probe(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any]:
    """All-reduce the ranks and round-trip a value through the control-plane store."""
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    ctx.store.set(f"probe/{ctx.rank}", str(ctx.rank * 10))
    dist.barrier()
    peer = int(ctx.store.get(f"probe/{(ctx.rank + 1) % ctx.world_size}").decode())
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "sum": float(t.item()),
        "peer": peer,
        "resume": resume,
        "restart_count": ctx.restart_count,
        "worker_id": ctx.worker.id,
        "tags": list(ctx.worker.tags),
        "backend": ctx.backend,
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


def launch_fail(ctx: WorkerContext, job: JobConfig, resume: bool) -> None:
    if ctx.rank == 1:
        raise ValueError("boom from rank one: bad shard 42")
    dist.barrier()


def launch_config_fail(ctx: WorkerContext, job: JobConfig, resume: bool) -> None:
    raise ConfigError([("strategy.num_replicas", "too many replicas (got 9)")])


def launch_crash_once(ctx: WorkerContext, job: JobConfig, resume: bool) -> dict[str, Any]:
    """Rank 1 SIGKILLs itself on the first attempt; the agent restarts the group."""
    if ctx.rank == 1 and ctx.restart_count == 0:
        os.kill(os.getpid(), 9)
    dist.barrier()
    return {"resume": resume, "restart_count": ctx.restart_count}
