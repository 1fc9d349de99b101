"""``BlockWise`` with a perfect-square TP size: 2-D (grid) tensor-parallel linear layers.

A run of ``Linear`` layers (with element-wise modules between them) becomes a 2-D region
on the ``g x g`` grid of :mod:`paratrain.comm.tp_grid`: the first layer keeps its block of
the replicated input, every layer keeps ``W[out_j, in_i]`` (1/g^2 of the weight, the
``BlockWise`` partition of ``partition_tensor``) and ``b_j``, element-wise modules act on
blocks, and the last layer all-gathers its output. Each sharded parameter carries
``tp_grid``: the (comm, dim, sizes) gathers that rebuild the full tensor, in order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.comm.tp_grid import GridComms, grid_enter, grid_exit, grid_linear, grid_sizes

from .layers import RegionState

__all__ = ["GridLinear", "grid_steps", "narrow_to_shard"]


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
        if self.enter:
            x, self.state.grid_rows = grid_enter(x, self.grid, self.in_sizes)
        y = grid_linear(x, self.weight, self.bias, self.grid, self.in_sizes,
                        self.state.compute_dtype)
        if self.leave:
            y = grid_exit(y, self.grid, self.out_sizes, self.state.grid_rows)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (block {tuple(self.weight.shape)} "
                f"at grid ({self.grid.i}, {self.grid.j})), enter={self.enter}, leave={self.leave}")
