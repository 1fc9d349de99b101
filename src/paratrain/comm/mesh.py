"""A device mesh of named dimensions over a run's ranks (:class:`Mesh`, pure arithmetic), laid
out row-major, outermost first (torchtitan's ``dp x tp``, Megatron's order): ``rank = dp * T +
tp``, so a ``tp`` group is a row of ``T`` consecutive ranks (one replica's shards, on the fastest
links) and a ``dp`` group a column (one shard of every replica: the data-parallel mean, ZeRO);
``("pp", "tp")`` likewise; the groups ``init_device_mesh`` would make for this shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Mesh:
    """Ranks ``0 .. prod(sizes) - 1`` laid out row-major over ``dims`` (module doc)."""

    dims: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.dims) != len(self.sizes) or not self.dims:
            raise ValueError(f"Mesh: one size per dimension (dims {self.dims}, sizes {self.sizes})")
        if len(set(self.dims)) != len(self.dims):
            raise ValueError(f"Mesh: dimension names repeat: {self.dims}")
        if any(int(s) < 1 for s in self.sizes):
            raise ValueError(f"Mesh: sizes must be >= 1 (got {self.sizes})")

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def _stride(self, axis: int) -> int:
        return math.prod(self.sizes[axis + 1:])

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s index along every dimension."""
        if not 0 <= rank < self.world:
            raise ValueError(f"Mesh: rank {rank} outside a world of {self.world}")
        return {d: (rank // self._stride(i)) % s for i, (d, s) in enumerate(zip(self.dims, self.sizes,
                                                                                 strict=True))}

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim``: the ranks that differ only in their ``dim`` index, in
        order of the other coordinates (so rank ``r`` lies in ``groups(dim)[k]`` for one k)."""
        if dim not in self.dims:
            raise ValueError(f"Mesh: no dimension {dim!r} (dims: {', '.join(self.dims)})")
        axis = self.dims.index(dim)
        stride, n = self._stride(axis), self.sizes[axis]
        out: list[list[int]] = []
        for r in range(self.world):
            if (r // stride) % n == 0:
                out.append([r + k * stride for k in range(n)])
        return out

    def describe(self) -> dict[str, object]:
        """What ``paratrain graph`` / ``validate --explain`` show: the shape, the rank
        formula (``rank = dp*2 + tp``) and every dimension's groups."""
        terms = [d if self._stride(i) == 1 else f"{d}*{self._stride(i)}" for i, d in enumerate(self.dims)]
        return {"dims": list(self.dims), "sizes": [int(s) for s in self.sizes],
                "layout": "rank = " + " + ".join(terms),
                "groups": {d: self.groups(d) for d in self.dims}}

    @staticmethod
    def of(**sizes: int) -> Mesh:
        """``Mesh.of(dp=2, tp=2)``: dimensions in the order given, outermost first."""
        return Mesh(tuple(sizes), tuple(int(s) for s in sizes.values()))
