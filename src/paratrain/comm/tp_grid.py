"""2-D tensor parallelism for ``BlockWise``: linear layers on a ``g x g`` grid of ranks.

With ``tp = g^2`` ranks in a TP group, TP-local index ``t = i g + j`` sits at grid row
``i`` and grid column ``j``; its row group is ``R_i = {(i, *)}`` and its column group
``C_j = {(*, j)}`` (group-local index ``j`` in ``R_i``, ``i`` in ``C_j``).

Inside a 2-D region an activation ``X [B, F]`` is held as blocks ``X_ij = X[B_i, F_j]``:
batch rows split over grid rows, features over grid columns (ceil-sized chunks). A
``Linear`` ``Y = X W^T + b`` with ``W [out, in]`` keeps ``W_ij = W[out_j, in_i]`` on rank
``(i, j)`` (1/g^2 of the weight) and ``b_j`` (replicated on ``C_j``). Per layer
(Xu et al. 2021, "An Efficient 2D Method for Training Super-Large Deep Learning Models",
after SUMMA, van de Geijn & Watts 1997; we gather whole panels in one all-gather instead
of ``g`` broadcast steps: the same bytes in fewer calls):

- forward: ``X_i: = all_gather_{R_i}(X_ij)`` along features, ``W_j: = all_gather_{C_j}(W_ij)``
  along ``in``; ``Y_ij = X_i: W_j:^T + b_j`` (already in the block layout of the output);
- backward: ``dX_ij = reduce_scatter_{R_i}(dY_ij W_j:)`` (the sum over ``j``),
  ``dW_ij = reduce_scatter_{C_j}(dY_ij^T X_i:)`` (the sum over the row blocks ``i``),
  ``db_j = all_reduce_{C_j}(sum_rows dY_ij)``.

Entering the region keeps the rank's block of a replicated input (backward: all-gather
of the gradient blocks); leaving it all-gathers the blocks (backward: keep the own
block): the existing scatter/gather region operators, once per grid dimension.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from .tp_ops import TPComm, _fp32, _mm, _rows, _wgrad, gather_from_region, scatter_to_region

__all__ = ["GridComms", "build_grid", "grid_enter", "grid_exit", "grid_linear", "grid_sizes"]


class GridComms:
    """The row and column communicators of this rank's grid position."""

    def __init__(self, row: TPComm, col: TPComm, g: int) -> None:
        self.row, self.col, self.g = row, col, g

    @property
    def i(self) -> int:
        """Grid row (the index in the column group)."""
        return self.col.rank

    @property
    def j(self) -> int:
        """Grid column (the index in the row group)."""
        return self.row.rank


def grid_sizes(n: int, g: int) -> list[int]:
    """Ceil-sized chunk lengths of ``n`` over ``g`` grid slots (zeros at the end)."""
    per = -(-n // g) if n else 0
    return [max(0, min(per, n - k * per)) for k in range(g)]


def build_grid(tp: TPComm) -> GridComms:
    """Row and column groups of every TP group (collective over the world when a process
    group is initialised: every rank creates every sub-group, in the same order).

    TP groups are the consecutive rank blocks of :func:`~.tp_ops.build_tp_groups`. Without
    a process group (a dry run), the comms have no group and only their indices matter.
    """
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
    row: TPComm | None = None
    col: TPComm | None = None
    for start in range(0, world, p):
        for r in range(g):
            ranks = [start + r * g + c for c in range(g)]
            grp = dist.new_group(ranks)
            if me in ranks:
                row = TPComm(grp, ranks, rank=me, async_op=True, stats=tp.stats)
        for c in range(g):
            ranks = [start + r * g + c for r in range(g)]
            grp = dist.new_group(ranks)
            if me in ranks:
                col = TPComm(grp, ranks, rank=me, async_op=True, stats=tp.stats)
    assert row is not None and col is not None
    return GridComms(row, col, g)


class _GridLinear(Function):
    """``Y_ij = all_gather_R(X_ij) all_gather_C(W_ij)^T + b_j`` (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                grid: GridComms, in_sizes: list[int], cdt: torch.dtype | None) -> torch.Tensor:
        # Both panels travel at once (different groups, so they overlap).
        hx = grid.row.all_gather(x.contiguous(), -1, in_sizes, async_op=True)
        hw = grid.col.all_gather(w.contiguous(), 1, in_sizes, async_op=True)
        xf, wf = hx.wait(), hw.wait()   # [..., B_i, in], [out_j, in]
        y = _mm(_rows(xf), wf.t(), cdt).reshape(*xf.shape[:-1], wf.shape[0])
        if b is not None:
            y = y + b
        ctx.save_for_backward(xf, wf)
        ctx.grid, ctx.in_sizes, ctx.cdt, ctx.has_bias = grid, in_sizes, cdt, b is not None
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> Any:
        xf, wf = ctx.saved_tensors
        grid, cdt = ctx.grid, ctx.cdt
        gy = gy.contiguous()
        gx_full = _mm(_rows(gy), wf, cdt).reshape(*gy.shape[:-1], wf.shape[1])
        # The input-gradient reduce-scatter overlaps the weight-gradient matmul.
        hx = grid.row.reduce_scatter(_fp32(gx_full), -1, ctx.in_sizes, async_op=True)
        hw = grid.col.reduce_scatter(_fp32(_wgrad(gy, xf, cdt)), 1, ctx.in_sizes, async_op=True)
        gb = grid.col.all_reduce(_fp32(_rows(gy).sum(0))) if ctx.has_bias else None
        return hx.wait(), hw.wait(), gb, None, None, None


def grid_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, grid: GridComms,
                in_sizes: list[int], compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One 2-D linear layer on block ``x`` with weight block ``w = W[out_j, in_i]``."""
    out: torch.Tensor = _GridLinear.apply(x, w, b, grid, in_sizes, compute_dtype)
    return out


def grid_enter(x: torch.Tensor, grid: GridComms, feature_sizes: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Keep block ``X[B_i, F_j]`` of a replicated ``x``; returns it and the row split."""
    rows = grid_sizes(x.shape[0], grid.g)
    blk = scatter_to_region(x, grid.col, 0, rows)
    return scatter_to_region(blk, grid.row, -1, feature_sizes), rows


def grid_exit(y: torch.Tensor, grid: GridComms, feature_sizes: list[int], rows: list[int]) -> torch.Tensor:
    """All-gather the blocks into the replicated ``Y`` (features, then rows)."""
    full_features = gather_from_region(y, grid.row, -1, feature_sizes)
    return gather_from_region(full_features, grid.col, 0, rows)
