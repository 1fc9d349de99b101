"""Worker functions for Interleaved1F1B with a replicated worker: a model whose two workers'
chunks sit under one module each (``a.p``, ``a.q`` on worker-0; ``b.p``, ``b.q`` on
worker-1), run ``a.p -> b.p -> a.q -> b.q``, so ``[subgraphs.b]`` covers worker-1's whole
part (its two non-adjacent chunks) and can be replicated on a third worker."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from _workers_mesh import OPTIMIZERS, SEED
from paratrain.comm.context import WorkerContext
from paratrain.config import load_job
from paratrain.config.job import JobConfig


class Interleaved(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.a = nn.ModuleDict({"p": nn.Sequential(nn.Linear(64, 32), nn.ReLU()),
                                "q": nn.Sequential(nn.Linear(32, 24), nn.Tanh())})
        self.b = nn.ModuleDict({"p": nn.Sequential(nn.Linear(32, 32), nn.ReLU()),
                                "q": nn.Linear(24, num_classes)})

    def forward(self, x: Any) -> Any:
        return self.b["q"](self.a["q"](self.b["p"](self.a["p"](x))))


def interleaved(num_classes: int) -> nn.Module:
    return Interleaved(num_classes)


def job_il(tmp: str, name: str, *, mesh: bool, optimizer: str = "adamw", steps: int = 4,
           replicas: int = 2, micro: int = 4, shard: str = "none", checkpoint_every: int = 0) -> JobConfig:
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": SEED, "output_dir": tmp, "checkpoint_every": checkpoint_every},
        "model": {"factory": "_workers_mp_interleaved_dp:interleaved"}, "data": {"name": "digits"},
        "train": {"epochs": 1, "batch_size": 16, "max_steps": steps, "eval_every": 1,
                  "grad_clip_norm": 0.1, "optimizer": copy.deepcopy(OPTIMIZERS[optimizer])},
    }
    if mesh:
        doc["strategy"] = {"type": "ModelParallel",
                           "communication": {"protocol": "Pipeline", "micro_batch_size": micro,
                                             "schedule": "Interleaved1F1B", "virtual_stages": 2},
                           "partitions": [{"node_ids": ["a.p"], "target": {"WorkerId": "worker-0"}},
                                          {"node_ids": ["b.p"], "target": {"WorkerId": "worker-1"}},
                                          {"node_ids": ["a.q"], "target": {"WorkerId": "worker-0"}},
                                          {"node_ids": ["b.q"], "target": {"WorkerId": "worker-1"}}]}
        if replicas > 1:
            doc["subgraphs"] = {"b": {"type": "DataParallel", "num_replicas": replicas,
                                      "aggregation": {"method": "AllReduce"},
                                      **({"shard": shard} if shard != "none" else {})}}
        doc["workers"] = [{"id": f"worker-{i}"} for i in range(1 + replicas)]
    return load_job(doc)


def runs_il(ctx: WorkerContext, tmp: str, cases: list[tuple[str, dict[str, Any], bool]]) -> dict[str, Any]:
    from paratrain.executors.model_parallel.runner import worker_main

    return {name: worker_main(ctx, job_il(tmp, name, mesh=True, **copy.deepcopy(kw)), resume)
            for name, kw, resume in cases}
