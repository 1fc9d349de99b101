"""The process groups of 2-D tensor parallelism (``BlockWise``, ``tp = g^2``): TP-local index
``t = i g + j`` sits at grid row ``i`` and column ``j``, in row group ``R_i = {(i, *)}`` (index
``j``) and column group ``C_j = {(*, j)}`` (index ``i``). The layers that run collectives on
them are in :mod:`paratrain.tensor_parallel.grid`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist

from .comm import TPComm
from .comm import ceil_sizes as grid_sizes

__all__ = ["GridComms", "build_grid", "grid_sizes"]


@dataclass
class GridComms:
    """The row and column communicators of this rank's grid position."""

    row: TPComm
    col: TPComm
    g: int

    @property
    def i(self) -> int:
        """Grid row (the index in the column group)."""
        return self.col.rank

    @property
    def j(self) -> int:
        """Grid column (the index in the row group)."""
        return self.row.rank


def build_grid(tp: TPComm) -> GridComms:
    """Row and column groups of every TP group (the consecutive rank blocks of
    :func:`~.groups.build_tp_groups`): collective, every rank creates every sub-group in one
    order. Without a process group (a dry run) only the comms' indices matter."""
    p = tp.size
    g = math.isqrt(p)
    if g * g != p:
        raise ValueError(f"a 2-D grid needs a perfect-square TP size (got {p})")
    i, j = divmod(tp.rank, g)
    me = tp.global_rank
    if tp.group is None or not dist.is_initialized():
        return GridComms(TPComm(None, [tp.ranks[i * g + c] for c in range(g)], rank=me, stats=tp.stats),
                         TPComm(None, [tp.ranks[r * g + j] for r in range(g)], rank=me, stats=tp.stats),
                         g)
    world = dist.get_world_size()
    base = tp.ranks[0]
    if tp.ranks != list(range(base, base + p)) or world % p:
        raise ValueError(f"TP group {tp.ranks} is not a consecutive block of the world ({world})")
    mine: list[TPComm] = []  # this rank's row, then its column
    for start in range(0, world, p):
        rows = [[start + r * g + c for c in range(g)] for r in range(g)]
        for ranks in [*rows, *(list(col) for col in zip(*rows, strict=True))]:
            grp = dist.new_group(ranks)
            if me in ranks:
                mine.append(TPComm(grp, ranks, rank=me, async_op=True, stats=tp.stats))
    return GridComms(mine[0], mine[1], g)
