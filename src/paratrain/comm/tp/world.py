"""World-level helpers of the tensor-parallel executor: a barrier, the mean of a few
floats over all ranks (one float64 all-reduce), an integer and a whole module broadcast
from one rank. Each is the identity without an initialised process group of size > 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["broadcast_module_", "world_barrier", "world_mean"]


def world_barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def world_mean(values: Sequence[float], device: torch.device | None = None) -> list[float]:
    """Mean of ``values`` over all ranks (float64); identity in one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def broadcast_module_(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's copy of ``module`` equal to rank ``src``'s (in place), so that the
    shards cut from it fit together whatever randomness a model factory used."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in list(module.state_dict().values()):
            dist.broadcast(t, src=src)
