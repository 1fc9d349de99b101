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


# ------------------------------------------------------------------ DataParallel parity


def dp_job(tmp: str, name: str, world: int, aggregation: dict[str, Any], **extra: Any) -> JobConfig:
    """A tiny DataParallel job: MLP(64->16->10) on digits, 4 steps of 8 rows per replica."""
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": 3, "output_dir": tmp, "checkpoint_every": 0},
        "model": {"name": "mlp", "hidden": [16]},
        "data": {"name": "digits"},
        "train": {"epochs": 1, "batch_size": 8, "max_steps": 4,
                  "optimizer": {"name": "sgd", "lr": 0.2, "momentum": 0.9}},
        "strategy": {"type": "DataParallel", "num_replicas": world, "aggregation": aggregation},
    }
    for k, v in extra.items():
        doc[k] = v
    from paratrain.config import load_job

    return load_job(doc)


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().tolist()


def ddp_reference(ctx: WorkerContext, job: JobConfig) -> list[float]:
    """torch DistributedDataParallel on the same shards, same seed, same optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.data import load_data
    from paratrain.executors.data_parallel import shard_indices
    from paratrain.models import build_model
    from paratrain.training import build_optimizer, seed_everything

    seed_everything(job.run.seed)
    bundle = load_data(job.data, seed=job.run.seed)
    x, y = bundle.train.tensors
    model = build_model(job.model, input_shape=bundle.input_shape, num_classes=bundle.num_classes)
    ddp = DDP(model)
    opt = build_optimizer(ddp.parameters(), job.train.optimizer)
    idx = shard_indices(len(y), world=ctx.world_size, rank=ctx.rank, seed=job.run.seed, epoch=0)
    bs = job.train.batch_size
    for b in range(job.train.max_steps or 1):
        sel = idx[b * bs : (b + 1) * bs]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(x[sel]), y[sel]).backward()
        opt.step()
    return _flat(model)


def dp_parity(ctx: WorkerContext, tmp: str, variants: list[tuple[str, Any]]) -> dict[str, Any]:
    """Train every variant on the same ranks; return each one's flat parameters."""
    from paratrain.executors.data_parallel import train_replica

    out: dict[str, Any] = {}
    for name, agg in variants:
        if name == "DDP":
            out[name] = ddp_reference(ctx, dp_job(tmp, "ddp", ctx.world_size, {"method": "AllReduce"}))
            continue
        spec = agg if isinstance(agg, dict) else {"method": "AllReduce"}
        job = dp_job(tmp, f"{name}-{ctx.world_size}", ctx.world_size, spec)
        model, summary = train_replica(ctx, job, False, aggregation=None if isinstance(agg, dict) else agg,
                                       plot=False)
        out[name] = {"params": _flat(model), "summary": summary}
    return out
