"""Worker functions for the pp x dp x tp test: a 2-stage pipeline whose second stage is
replicated twice, each stage 2-way tensor-parallel, on 6 gloo ranks (3 logical workers x tp 2)."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from _workers_mesh import OPTIMIZERS, SEED
from paratrain.comm.context import WorkerContext
from paratrain.config import load_job
from paratrain.config.job import JobConfig

FACTORY = "_workers_mesh3d:front_back"


class FrontBack(nn.Module):
    """64 -> 32 -> 16 -> 16 -> classes: a column- then row-parallel Linear pair in ``front`` and
    another in ``back`` (under TP); ``back`` is a whole stage, so it can be replicated."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.front = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.back = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, num_classes))

    def forward(self, x: Any) -> Any:
        return self.back(self.front(x))


def front_back(num_classes: int) -> nn.Module:
    return FrontBack(num_classes)


def job_3d(tmp: str, name: str, *, mesh: bool, optimizer: str = "sgd", schedule: str = "1F1B",
           steps: int = 4, checkpoint_every: int = 0, clip: float = 0.1, replicas: int = 2,
           micro: int = 4, tp: int = 2, shard: str = "none") -> JobConfig:
    """16 rows a step, micro-batches of ``micro`` (the ``replicas`` of ``back`` share each),
    clipping active, ``tp``-way tensor parallelism in each stage (``replicas = 1`` / ``tp = 1``:
    without that dimension), ``shard``: ZeRO over ``back``'s replicas; ``mesh = False``: the
    unpartitioned Local model."""
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": SEED, "output_dir": tmp, "checkpoint_every": checkpoint_every},
        "model": {"factory": FACTORY}, "data": {"name": "digits"},
        "train": {"epochs": 1, "batch_size": 16, "max_steps": steps, "eval_every": 1,
                  "grad_clip_norm": clip, "optimizer": copy.deepcopy(OPTIMIZERS[optimizer])},
    }
    if mesh:
        doc["strategy"] = {"type": "ModelParallel",
                           "communication": {"protocol": "Pipeline", "micro_batch_size": micro, "schedule": schedule},
                           "partitions": [{"node_ids": ["front"], "target": {"WorkerId": "worker-0"}},
                                          {"node_ids": ["back"], "target": {"WorkerId": "worker-1"}}]}
        if replicas > 1:
            doc["subgraphs"] = {"back": {"type": "DataParallel", "num_replicas": replicas,
                                        "aggregation": {"method": "AllReduce"},
                                        **({"shard": shard} if shard != "none" else {})}}
        if tp > 1:
            doc["tensor_parallel"] = {"tensor_parallel_size": tp}
    return load_job(doc)


def runs_3d(ctx: WorkerContext, tmp: str, cases: list[tuple[str, dict[str, Any], bool]]) -> dict[str, Any]:
    """Each ``(name, job_3d kwargs, resume)`` through ModelParallel's ``worker_main``; rank 0's
    summaries by name."""
    from paratrain.executors.model_parallel.runner import worker_main

    return {name: worker_main(ctx, job_3d(tmp, name, mesh=True, **copy.deepcopy(kw)), resume)
            for name, kw, resume in cases}
