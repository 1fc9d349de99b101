"""Worker functions for tests/executors/data_parallel/test_dp_task.py (module-level, importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch

from paratrain.comm import buckets as B
from paratrain.comm import collectives as C
from paratrain.comm.context import WorkerContext
from paratrain.config import load_job
from paratrain.task import fetch_batch, resolve_task


class SumLoss:
    """A task whose loss is summed over the batch instead of averaged (the wrong reduction
    a non-vacuity check must catch)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        return self.inner.loss(output, batch) * float(batch[0].shape[0])


def task_model_batch(doc: dict[str, Any], batch_rows: int, *, wrong: bool) -> tuple[Any, Any, Any, Any]:
    """The job's task, a freshly seeded model and the first ``batch_rows`` training rows."""
    job = load_job(doc)
    task = resolve_task(job)
    train, test = task.datasets(job.run.seed)
    torch.manual_seed(job.run.seed)
    model = task.build_model(job.model, train)
    batch = fetch_batch(train, torch.arange(batch_rows))
    return (SumLoss(task) if wrong else task), model, batch, test


def grads_of(model: torch.nn.Module) -> list[list[float]]:
    return [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).tolist()
            for p in model.parameters()]


def dp_loss_and_grads(ctx: WorkerContext, doc: dict[str, Any], batch_rows: int, wrong: bool) -> dict[str, Any]:
    """One DataParallel backward of this rank's share of a ``batch_rows`` batch (rank r takes
    rows r*b..(r+1)*b), AllReduce-combined by the DataParallel engine; the loss averaged."""
    from paratrain.executors.data_parallel.aggregation import DataParallelEngine, build_aggregator

    task, model, batch, test = task_model_batch(doc, batch_rows, wrong=wrong)
    b = batch_rows // ctx.world_size
    mine = tuple(t[ctx.rank * b:(ctx.rank + 1) * b] for t in batch)
    counter = C.CommCounter()
    agg = build_aggregator("AllReduce", model, group=ctx.group, counter=counter,
                           bucket_bytes=B.bucket_bytes_of(25.0), compressor=None, gamma=None)
    eng = DataParallelEngine(model, task, test, ctx=ctx, precision="fp32", agg=agg, counter=counter)
    loss = eng.forward_backward(mine, weight=1.0, last=True)
    eng.sync()
    agg.close()
    return {"loss": eng.mean_over_ranks(loss), "grads": grads_of(model)}


def dp_cases(ctx: WorkerContext, cases: list[tuple[dict[str, Any], int, bool]]) -> list[dict[str, Any]]:
    """:func:`dp_loss_and_grads` for every ``(doc, batch_rows, wrong)`` case, in one launch."""
    return [dp_loss_and_grads(ctx, doc, rows, wrong) for doc, rows, wrong in cases]


def dp_cases_world_and_pairs(ctx: WorkerContext, cases: list[tuple[dict[str, Any], int, bool]],
                             pair_cases: list[tuple[dict[str, Any], int, bool]],
                             job: dict[str, Any]) -> dict[str, Any]:
    """:func:`dp_cases` over the whole world, then over 2-rank gloo groups (ranks 0-1 and
    2-3 of a 4-rank world, each a data-parallel group of its own): a 2-replica run and a
    4-replica run from one launch. Then ranks 0-1 train ``job`` (2 replicas) through
    ``train_replica``, what ``runner.run`` launches on every rank, and return its summary
    (only the pair holding global rank 0: ``train_replica`` broadcasts from global rank 0)."""
    from dataclasses import replace

    import torch.distributed as dist

    from paratrain.executors.data_parallel.runner import train_replica

    whole = dp_cases(ctx, cases)
    layout = [[0, 1], [2, 3]]
    groups = [dist.new_group(ranks) for ranks in layout]  # every rank creates every group
    pair = next(ranks for ranks in layout if ctx.rank in ranks)
    mine = groups[layout.index(pair)]
    sub = replace(ctx, rank=pair.index(ctx.rank), world_size=2, group=mine)
    pairs = dp_cases(sub, pair_cases)
    summary = train_replica(sub, load_job(job), False, plot=False)[1] if 0 in pair else None
    return {"world": whole, "pairs": pairs, "job": summary}
