"""Worker functions for the mesh (ZeRO x tensor parallel) tests: 4 gloo ranks laid out
``dp 2 x tp 2`` (rank = dp*2 + tp)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from paratrain.comm.context import WorkerContext
from paratrain.config import load_job
from paratrain.config.job import JobConfig

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd": {"name": "sgd", "lr": 0.2, "momentum": 0.9, "weight_decay": 0.01},
    "adamw": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
}
LEVELS = ("optimizer", "gradients", "parameters")
SEED = 5
DP, TP, BATCH = 2, 2, 8


def mesh_job(tmp: str, name: str, *, shard: str, optimizer: str = "adamw", steps: int = 4,
             dp: int = DP, tp: int = TP, batch: int = BATCH, clip: float | None = 0.5,
             checkpoint_every: int = 0, tp_extra: dict[str, Any] | None = None,
             strategy_extra: dict[str, Any] | None = None) -> JobConfig:
    """An MLP 64->16->16->10 on digits (fc0 column-, fc1 row-parallel, head replicated),
    ``dp`` replicas of ``batch`` rows at ZeRO ``shard`` with ``tp``-way tensor parallelism
    (``dp = tp = 1``: the unpartitioned Local model on ``batch`` rows)."""
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": SEED, "output_dir": tmp, "checkpoint_every": checkpoint_every},
        "model": {"name": "mlp", "hidden": [16, 16]},
        "data": {"name": "digits"},
        "train": {"epochs": 1, "batch_size": batch, "max_steps": steps, "eval_every": 1,
                  "optimizer": copy.deepcopy(OPTIMIZERS[optimizer]),
                  **({"grad_clip_norm": clip} if clip is not None else {})},
    }
    if dp > 1 or shard != "none":
        doc["strategy"] = {"type": "DataParallel", "num_replicas": dp,
                           "aggregation": {"method": "AllReduce"},
                           **({"shard": shard} if shard != "none" else {}), **(strategy_extra or {})}
    if tp > 1:
        doc["tensor_parallel"] = {"tensor_parallel_size": tp, **(tp_extra or {})}
    return load_job(doc)


def run_jobs(ctx: WorkerContext, tmp: str, cases: list[tuple[str, dict[str, Any], bool]]
             ) -> dict[str, Any]:
    """Each ``(name, mesh_job kwargs, resume)`` through the tensor-parallel executor's
    ``worker_main`` on this rank; rank 0's summaries by name."""
    from paratrain.executors.tensor_parallel.runner import worker_main

    out: dict[str, Any] = {}
    for name, kwargs, resume in cases:
        summary = worker_main(ctx, mesh_job(tmp, name, **copy.deepcopy(kwargs)), resume)
        out[name] = summary
    return out


def first_batch(job: JobConfig, *, dp: int, replica: int) -> Any:
    """The rows replica ``replica`` of ``dp`` trains on at step 0 (the loop's order)."""
    from paratrain.executors.tensor_parallel.runner import dp_order
    from paratrain.task import resolve_task

    task = resolve_task(job)
    train, _ = task.datasets(job.run.seed)
    rows = dp_order(len(train), dp=dp, replica=replica, seed=job.run.seed, epoch=0)[: job.train.batch_size]
    return task, train, train[rows]


def mesh_grads(ctx: WorkerContext, tmp: str, levels: list[str], micro_batches: int,
               tp_extra: dict[str, Any] | None = None, prefix: str = "") -> dict[str, Any]:
    """One forward/backward/sync of step 0 at each ZeRO level on the dp x tp mesh: every
    owned piece's gradient with its dense name and composed shard spec, the global squared
    norm the engine clips by, and the rank's mesh coordinates."""
    from paratrain.comm.collectives import CommCounter, broadcast_module_
    from paratrain.comm.tp.groups import build_tp_groups
    from paratrain.executors.tensor_parallel.zero import MeshZeroEngine
    from paratrain.tensor_parallel import parallelize
    from paratrain.training import seed_everything

    out: dict[str, Any] = {}
    groups = build_tp_groups(TP)
    assert groups.mesh is not None
    out["coords"] = groups.mesh.coords(ctx.rank)
    out["tp_ranks"], out["dp_ranks"] = groups.tp.ranks, groups.dp.ranks if groups.dp else None
    for level in levels:
        job = mesh_job(tmp, f"g-{level}", shard=level,
                       tp_extra={"micro_batches": micro_batches, **(tp_extra or {})})
        assert job.tensor_parallel is not None
        seed_everything(job.run.seed)
        task, train, batch = first_batch(job, dp=DP, replica=groups.tp_index)
        model = task.build_model(job.model, train)
        broadcast_module_(model)
        tpm = parallelize(model, job.tensor_parallel, dataclasses.replace(groups, dp=None))
        eng = MeshZeroEngine(tpm, task, None, groups=groups, device=torch.device("cpu"),
                             is_main=ctx.is_main, world_group=ctx.group, precision="fp32", level=level,
                             units=None, micro_batches=job.tensor_parallel.micro_batches,
                             broadcast_buffers=True, counter=CommCounter(), bucket_bytes=1 << 20)
        loss = eng.forward_backward(batch, weight=1.0, last=True)
        eng.sync()
        names, specs = eng.model_names(), eng.model_shards()
        pieces = {}
        for key, p in eng.model.named_parameters():
            if p.grad is not None:
                pieces[names[key]] = (specs.get(key), p.grad.detach().clone())
        out[prefix + level] = {"pieces": pieces, "sq_norm": eng.grad_sq_norm(), "loss": loss}
        eng.close()
    groups.tp.close()
    return out


def mesh_worker(ctx: WorkerContext, tmp: str, cases: list[tuple[str, dict[str, Any], bool]]
                ) -> dict[str, Any]:
    """:func:`mesh_grads` at every level (2 micro-batches) and at ZeRO-2 under sequence
    parallelism (``rs-gradients``), then :func:`run_jobs`."""
    grads = mesh_grads(ctx, tmp, list(LEVELS), 2)
    # sequence parallel: the fc1 bias inside the region is summed over TP on the owned rows
    grads.update(mesh_grads(ctx, tmp, ["gradients"], 1, {"communication_pattern": "ReduceScatter"},
                            prefix="rs-"))
    return {"grads": grads, "jobs": run_jobs(ctx, tmp, cases)}


def pipeline_job(tmp: str, name: str, *, tp: int, optimizer: str = "sgd", schedule: str = "1F1B",
                 steps: int = 4, checkpoint_every: int = 0, clip: float = 0.1) -> JobConfig:
    """The same MLP as :func:`mesh_job` (16 rows a step) as 2 pipeline stages (``fc1``,
    ``act1``, ``head`` on worker-1: the cut falls between the column-parallel ``fc0`` and the
    row-parallel ``fc1``, so each lane sends its shard) with ``tp``-way tensor parallelism in
    each stage, micro-batches of 4; under Interleaved1F1B 4 chunks placed round-robin
    (``fc0`` | ``act0`` | ``fc1, act1`` | ``head``, 2 virtual stages a worker); ``tp = 0``: the
    unpartitioned Local model."""
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": SEED, "output_dir": tmp, "checkpoint_every": checkpoint_every},
        "model": {"name": "mlp", "hidden": [16, 16]}, "data": {"name": "digits"},
        "train": {"epochs": 1, "batch_size": 16, "max_steps": steps, "eval_every": 1,
                  "grad_clip_norm": clip, "optimizer": copy.deepcopy(OPTIMIZERS[optimizer])},
    }
    if tp:
        parts = [(["fc1", "act1", "head"], "worker-1")]
        comm: dict[str, Any] = {"protocol": "Pipeline", "micro_batch_size": 4, "schedule": schedule}
        if schedule == "Interleaved1F1B":  # 4 chunks round-robin: fc0 | act0 | fc1, act1 | head
            parts = [(["fc0"], "worker-0"), (["act0"], "worker-1"), (["fc1", "act1"], "worker-0"),
                     (["head"], "worker-1")]
            comm["virtual_stages"] = 2
        doc["strategy"] = {"type": "ModelParallel", "communication": comm,
                           "partitions": [{"node_ids": ids, "target": {"WorkerId": w}} for ids, w in parts]}
        doc["tensor_parallel"] = {"tensor_parallel_size": tp}
    return load_job(doc)


def pipeline_runs(ctx: WorkerContext, tmp: str, cases: list[tuple[str, dict[str, Any], bool]]
                  ) -> dict[str, Any]:
    """Each ``(name, pipeline_job kwargs, resume)`` through ModelParallel's ``worker_main``;
    rank 0's summaries by name."""
    from paratrain.executors.model_parallel.runner import worker_main

    return {name: worker_main(ctx, pipeline_job(tmp, name, tp=2, **copy.deepcopy(kw)), resume)
            for name, kw, resume in cases}
