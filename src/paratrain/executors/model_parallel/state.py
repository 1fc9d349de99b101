"""This rank's state by the model's names: the run's layout (for checkpoints resumable on
another placement), and every rank's parts gathered on rank 0 for the exported model (and
its ``parameters_sha256``)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

__all__ = ["layout_of", "gather_parts"]


def layout_of(plan: Any, replicas: Any, world: int, shards: dict[str, str] | None = None) -> dict[str, Any]:
    """The run's processes and placement (a checkpoint of another one is resumed by the
    model's names): the worker count and a digest of which nodes each rank runs (and, where
    a replicated stage is ZeRO-sharded, its ``shard``: its ranks hold rows then)."""
    where = [[s.index, s.rank, list(s.nodes)] for s in plan.segments]
    groups = {str(r): list(g) for r, g in sorted(replicas.groups.items())}
    sharded = {p: v for p, v in sorted((shards or {}).items()) if v != "none"}
    digest = hashlib.sha256(json.dumps([where, groups, *([sharded] if sharded else [])]).encode()).hexdigest()[:16]
    return {"strategy": "ModelParallel", "world": world, "placement": digest}


def gather_parts(rt: Any, own: dict[str, torch.Tensor], *, rank: int, world: int,
                  step: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's model tensors (by the model's names) on rank 0, in rank order (a
    replicated stage's replicas hold the same names and values: the first is kept)."""
    from safetensors.torch import load, save

    if rank != 0:
        blob = save({k: v.detach().cpu().contiguous().clone() for k, v in own.items()})
        rt.send_metric(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=0, step=step, slot=4)
        return []
    return [own] + [load(bytes(rt.recv_metric(src=r, step=step, slot=4).cpu().numpy().tobytes()))
                    for r in range(1, world)]
