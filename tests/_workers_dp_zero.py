"""Worker functions for the ZeRO (DataParallel ``shard``) multi-process tests."""

from __future__ import annotations

import copy
from typing import Any

import torch

from paratrain.comm.context import WorkerContext
from paratrain.config import load_job
from paratrain.config.job import JobConfig

LEVELS = ("none", "optimizer", "gradients", "parameters")
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd": {"name": "sgd", "lr": 0.2, "momentum": 0.9, "weight_decay": 0.01},
    "adam": {"name": "adam", "lr": 0.01},
    "adamw": {"name": "adamw", "lr": 0.01, "weight_decay": 0.1},
}
GPT: dict[str, Any] = {
    # strided examples and a small test split: the evaluation stays a fraction of a second
    "task": {"name": "language_model", "block_size": 8, "stride": 512},
    "data": {"name": "shakespeare", "test_fraction": 0.05},
    "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "dropout": 0.0},
}


def zero_job(tmp: str, name: str, world: int, shard: str, *, optimizer: str = "adam",
             steps: int = 3, **extra: Any) -> JobConfig:
    """A tiny DataParallel job (MLP 64->16->10 on digits, 8 rows per replica) at ``shard``;
    ``extra`` replaces top-level sections (``strategy_extra`` merges into the strategy)."""
    strategy: dict[str, Any] = {"type": "DataParallel", "num_replicas": world,
                                "aggregation": {"method": "AllReduce"}}
    if shard != "none":
        strategy["shard"] = shard
    strategy.update(extra.pop("strategy_extra", {}))
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": 3, "output_dir": tmp, "checkpoint_every": 0},
        "model": {"name": "mlp", "hidden": [16]},
        "data": {"name": "digits"},
        "train": {"epochs": 1, "batch_size": 8, "max_steps": steps,
                  "optimizer": copy.deepcopy(OPTIMIZERS[optimizer])},
        "strategy": strategy,
    }
    for k, v in extra.items():
        doc[k] = {**doc.get(k, {}), **v} if isinstance(v, dict) and k in ("train", "run") else v
    return load_job(doc)


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().tolist()


def zero_cases(ctx: WorkerContext, tmp: str, cases: list[tuple[str, str, str, dict[str, Any]]]
               ) -> dict[str, Any]:
    """Train each ``(label, shard, optimizer, extra)`` case; its parameters and summary."""
    from paratrain.executors.data_parallel.runner import train_replica

    out: dict[str, Any] = {}
    for label, shard, optimizer, extra in cases:
        job = zero_job(tmp, f"{label}-{ctx.world_size}", ctx.world_size, shard, optimizer=optimizer,
                       **copy.deepcopy(extra))
        model, summary = train_replica(ctx, job, False, plot=False)
        out[label] = {"params": _flat(model), "summary": summary}
    return out


def zero_resume(ctx: WorkerContext, tmp: str, steps: list[tuple[str, str, int, bool]]
                ) -> dict[str, Any]:
    """Train run folders in turn: ``(name, shard, max_steps, resume)`` (Adam, MLP)."""
    from paratrain.executors.data_parallel.runner import train_replica

    out: dict[str, Any] = {}
    for name, shard, n, resume in steps:
        job = zero_job(tmp, name, ctx.world_size, shard, steps=n)
        model, summary = train_replica(ctx, job, resume, plot=False)
        out[f"{name}:{n}"] = {"params": _flat(model), "summary": summary}
    return out


def flat_probe(ctx: WorkerContext) -> dict[str, Any]:
    """:class:`FlatShard` on real ranks: rank r contributes r+1 everywhere; the reduce-scatter
    must give the mean (not gloo's sum), the gather the whole tensors back."""
    from paratrain.comm.zero import FlatShard

    n, r = ctx.world_size, ctx.rank
    shapes = [(5, 3), (2,), (7,)]
    fs = FlatShard(shapes, world=n, rank=r)
    grads = [torch.full(s, float(r + 1)) for s in shapes]
    out = torch.empty(fs.numel)
    fs.reduce_scatter(grads, out)
    whole = [torch.arange(torch.Size(s).numel(), dtype=torch.float32).view(s) + 100 * i
             for i, s in enumerate(shapes)]
    got = [torch.empty(s) for s in shapes]
    fs.gather(fs.pack_own(whole, torch.empty(fs.numel)), got)
    return {"mean": [float(fs.view(out, i).mean()) if fs.pieces[i].length else None
                     for i in range(len(shapes))],
            "gathered": all(torch.equal(a, b) for a, b in zip(got, whole, strict=True))}


def zero_cases_probe(ctx: WorkerContext, tmp: str, cases: list[tuple[str, str, str, dict[str, Any]]]
                     ) -> dict[str, Any]:
    return {**zero_cases(ctx, tmp, cases), "probe": flat_probe(ctx)}
