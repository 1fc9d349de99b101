"""``BlockWise`` with a perfect-square TP size: 2-D (grid) tensor-parallel linear layers.

On the ``g x g`` grid of :mod:`paratrain.comm.tp.groups` (rank ``(i, j)``, row group ``R_i``,
column group ``C_j``) a run of Linears (element-wise modules between them) holds every
activation ``X [B, F]`` as blocks ``X_ij = X[B_i, F_j]`` and every ``Y = X W^T + b`` keeps
``W_ij = W[out_j, in_i]`` (1/g^2 of the weight, ``partition_tensor``'s BlockWise) and ``b_j``
(Xu et al. 2021, "An Efficient 2D Method for Training Super-Large Deep Learning Models", after
SUMMA; whole panels in one all-gather instead of ``g`` broadcast steps: the same bytes in
fewer calls). Forward: ``X_i: = all_gather_{R_i}(X_ij)``, ``W_j: = all_gather_{C_j}(W_ij)``,
``Y_ij = X_i: W_j:^T + b_j``; backward: ``dX_ij = reduce_scatter_{R_i}(dY_ij W_j:)``,
``dW_ij = reduce_scatter_{C_j}(dY_ij^T X_i:)``, ``db_j = all_reduce_{C_j}(sum_rows dY_ij)``.
The first layer keeps its block of the replicated input, the last all-gathers its output.
Each sharded parameter carries ``tp_grid``: the (comm, dim, sizes) gathers that rebuild it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.autograd import Function

from paratrain.comm.tp.comm import ceil_sizes as grid_sizes
from paratrain.comm.tp.groups import GridComms

from .autograd import _fp32, _mm, _rows, _wgrad, gather_from_region, scatter_to_region
from .layers import RegionState
from .memory import taped


class _GridLinear(Function):
    """``Y_ij = all_gather_R(X_ij) all_gather_C(W_ij)^T + b_j`` (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                grid: GridComms, in_sizes: list[int], cdt: torch.dtype | None) -> torch.Tensor:
        def panels() -> tuple[torch.Tensor, torch.Tensor]:
            # Both panels travel at once (different groups, so they overlap).
            hx = grid.row.all_gather(x.contiguous(), -1, in_sizes, async_op=True)
            hw = grid.col.all_gather(w.contiguous(), 1, in_sizes, async_op=True)
            return hx.wait(), hw.wait()

        # recomputation reads both panels back from the segment's tape (see .memory)
        xf, wf = taped(panels)   # [..., B_i, in], [out_j, in]
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


def grid_steps(p: nn.Parameter) -> list[tuple[Any, int, list[int]]] | None:
    """The gathers that rebuild a grid parameter (``None`` for other parameters)."""
    steps: list[tuple[Any, int, list[int]]] | None = getattr(p, "tp_grid", None)
    return steps


def narrow_to_shard(full: torch.Tensor, steps: list[tuple[Any, int, list[int]]]) -> torch.Tensor:
    """This rank's block of a full tensor, undoing ``steps`` (each comm keeps its index)."""
    for comm, dim, sizes in steps:
        r = comm.rank
        full = full.narrow(dim, sum(sizes[:r]), sizes[r])
    return full


class GridLinear(nn.Module):
    """``Y = X W^T + b`` on a grid; ``enter``/``leave`` open and close the 2-D region."""

    def __init__(self, in_features: int, out_features: int, *, grid: GridComms,
                 state: RegionState, bias: bool = True, enter: bool = False,
                 leave: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.grid, self.state, self.enter, self.leave = grid, state, enter, leave
        self.in_sizes = grid_sizes(in_features, grid.g)
        self.out_sizes = grid_sizes(out_features, grid.g)
        i, j = grid.i, grid.j
        self.weight = nn.Parameter(torch.empty(self.out_sizes[j], self.in_sizes[i]))
        self.bias = nn.Parameter(torch.zeros(self.out_sizes[j])) if bias else None
        # Rebuild W: gather in-blocks over the column group, then out-blocks over the row.
        self.weight.tp_grid = [(grid.col, 1, self.in_sizes), (grid.row, 0, self.out_sizes)]  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.tp_grid = [(grid.row, 0, self.out_sizes)]  # type: ignore[attr-defined]

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, grid: GridComms, state: RegionState,
                   enter: bool = False, leave: bool = False) -> GridLinear:
        m = cls(linear.in_features, linear.out_features, grid=grid, state=state,
                bias=linear.bias is not None, enter=enter, leave=leave)
        with torch.no_grad():
            m.weight.copy_(narrow_to_shard(linear.weight, m.weight.tp_grid))  # type: ignore[attr-defined]
            if m.bias is not None and linear.bias is not None:
                m.bias.copy_(narrow_to_shard(linear.bias, m.bias.tp_grid))  # type: ignore[attr-defined]
        return m.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid, state = self.grid, self.state
        if self.enter:  # keep block X[B_i, F_j] of the replicated input
            state.grid_rows = grid_sizes(x.shape[0], grid.g)
            rows = scatter_to_region(x, grid.col, 0, state.grid_rows)
            x = scatter_to_region(rows, grid.row, -1, self.in_sizes)
        y: torch.Tensor = _GridLinear.apply(x, self.weight, self.bias, grid, self.in_sizes,
                                            state.compute_dtype)
        if self.leave:  # all-gather the blocks: features, then rows
            y = gather_from_region(y, grid.row, -1, self.out_sizes)
            y = gather_from_region(y, grid.col, 0, state.grid_rows)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (block {tuple(self.weight.shape)} "
                f"at grid ({self.grid.i}, {self.grid.j})), enter={self.enter}, leave={self.leave}")


def replicas_of(p: nn.Parameter, tp: int) -> int:
    """How many ranks of a TP group of ``tp`` hold the same tensor as this rank's ``p``."""
    steps = grid_steps(p)
    if steps is not None:
        return max(1, tp // math.prod(len(sizes) for _, _, sizes in steps))
    if hasattr(p, "tp_shard_dim"):
        return 1
    return tp
