"""The tensor-parallel and data-parallel sub-groups of a run (:func:`build_tp_groups`): the
rows and columns of the ``dp x tp`` :class:`~paratrain.comm.mesh.Mesh`; under the
``Hierarchical`` pattern each TP group is also cut into per-host nodes with a leaders' group
(:mod:`paratrain.comm.groups`). The groups of 2-D tensor parallelism (``BlockWise``, ``tp =
g^2``, :func:`build_grid`): TP-local index ``t = i g + j`` sits at grid row ``i`` and column
``j``, in row group ``R_i = {(i, *)}`` (index ``j``) and column group ``C_j = {(*, j)}`` (index
``i``); the layers that run collectives on them are in :mod:`paratrain.tensor_parallel.grid`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..groups import describe_hierarchy, hierarchy_from_hosts, host_labels
from ..mesh import Mesh
from .comm import CommStats, TPComm, _Hier


@dataclass
class TPGroups:
    """The TP comm of this rank, and its DP comm (``None`` when there is one replica)."""

    tp: TPComm
    dp: TPComm | None
    tp_size: int
    dp_size: int
    tp_index: int  # which TP group (= DP rank)
    mesh: Mesh | None = None  # the dp x tp layout these groups are the rows and columns of


def build_tp_groups(tp_size: int, *, pattern: str = "AllReduce", async_op: bool = True,
                    fusion_threshold_bytes: int = 0, stats: CommStats | None = None) -> TPGroups:
    """Create the TP (and DP, hierarchical) sub-groups (collective); without an initialised
    process group, single-process comms."""
    stats = stats if stats is not None else CommStats()
    if not dist.is_available() or not dist.is_initialized():
        if tp_size != 1:
            raise ValueError(f"tensor_parallel_size {tp_size} needs an initialised process group "
                             "(world size 1 here)")
        return TPGroups(TPComm(None, [0], rank=0, pattern=pattern, async_op=async_op,
                               fusion_threshold_bytes=fusion_threshold_bytes, stats=stats),
                        None, 1, 1, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp_size < 1 or tp_size > world or world % tp_size:
        raise ValueError(f"tensor_parallel_size {tp_size} must be >= 1, at most the world size "
                         f"({world}) and divide it")
    dp_size = world // tp_size
    mesh = Mesh.of(dp=dp_size, tp=tp_size)
    my_tp: tuple[Any, list[int]] | None = None
    my_hier: _Hier | None = None
    world_nodes: list[list[int]] = []
    labels: list[str] = []
    if pattern == "Hierarchical":
        labels = host_labels()  # collective: every rank's host (and torchrun node)
        world_nodes = hierarchy_from_hosts(labels)
    for ranks in mesh.groups("tp"):  # the rows: every rank creates every group, in order
        grp = dist.new_group(ranks) if tp_size < world else dist.group.WORLD
        if rank in ranks:
            my_tp = (grp, ranks)
        if pattern == "Hierarchical":
            nodes = [[r for r in n if r in ranks] for n in world_nodes]
            nodes = [n for n in nodes if n]
            layout = describe_hierarchy(nodes, [labels[r] for r in ranks])
            leaders = [n[0] for n in nodes]
            node_groups = [dist.new_group(n) if len(n) > 1 else None for n in nodes]
            lead_group = dist.new_group(leaders) if len(leaders) > 1 else None
            for n, ng in zip(nodes, node_groups, strict=True):
                if rank in n:
                    my_hier = _Hier(ng, n, lead_group if rank == n[0] else None, n[0], layout)
    assert my_tp is not None
    tp = TPComm(my_tp[0], my_tp[1], rank=rank, pattern=pattern, async_op=async_op,
                fusion_threshold_bytes=fusion_threshold_bytes, stats=stats, hier=my_hier)
    dp: TPComm | None = None
    for ranks in mesh.groups("dp"):  # the columns
        grp = dist.new_group(ranks) if dp_size > 1 and dp_size < world else dist.group.WORLD
        if rank in ranks and dp_size > 1:
            dp = TPComm(grp, ranks, rank=rank, pattern="AllReduce", async_op=async_op,
                        fusion_threshold_bytes=fusion_threshold_bytes, stats=stats)
    return TPGroups(tp, dp, tp_size, dp_size, mesh.coords(rank)["dp"], mesh)


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
