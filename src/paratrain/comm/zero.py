"""Flat-buffer collectives of ZeRO (Rajbhandari et al. 2020): :class:`FlatShard`.

A unit's tensors are cut along dimension 0, as torch FSDP2's ``Shard(0)``: of tensor ``i``'s
``d_i`` rows (``w_i`` elements each) rank ``r`` owns ``[r c_i, min((r+1) c_i, d_i))``, ``c_i =
ceil(d_i / N)`` (possibly none), the shard spec ``{"shape": ..., "slices": [[0, start,
length]]}`` of :mod:`paratrain.training.reshard`, so a sharded run resumes on any world. Its
*flat shard* concatenates those rows zero-padded to ``c_i``, ``S = sum_i c_i w_i`` elements;
the unit travels as one ``N S`` buffer, ``[rank 0's | rank 1's | ...]``: one
``all_gather_into_tensor``, or one ``reduce_scatter`` of the SUM divided by ``N``, the mean on
every backend (gloo has no AVG; pytorch#162338: FSDP2 on gloo sums where it should average).
On one host, for units over ``shm.MIN_BYTES``, both go through shared memory instead
(:class:`~.shm.SyncArena`: each rank's buffer in its slot, read by the others).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .collectives import (
    CommCounter,
    all_gather_into_tensor,
    count_op,
    nbytes_of,
    reduce_scatter,
    world_size,
)
from .shm import SyncArena, sum_in_rank_order, sync_arena


@dataclass(frozen=True)
class Piece:
    """Where tensor ``index`` lies: rows ``[start, start + length)`` of the tensor on this
    rank, at ``offset`` in the flat shard; ``chunk`` rows per rank, ``row`` elements a row."""

    index: int
    shape: tuple[int, ...]
    chunk: int
    row: int
    offset: int
    start: int
    length: int

    @property
    def spec(self) -> dict[str, Any]:
        """The shard spec of :mod:`paratrain.training.reshard` (rows of dimension 0)."""
        return {"shape": list(self.shape), "slices": [[0, self.start, self.length]]}


class FlatShard:
    """Rank ``rank`` of ``world``'s dimension-0 shard of tensors of ``shapes`` (module doc)."""

    def __init__(self, shapes: Sequence[Sequence[int]], *, world: int, rank: int) -> None:
        self.world, self.rank = int(world), int(rank)
        self.pieces: list[Piece] = []
        offset = 0
        for i, shape in enumerate(shapes):
            shape = tuple(int(s) for s in shape)
            if not shape:
                raise ValueError("FlatShard: a 0-dimensional tensor has no rows to shard")
            rows = shape[0]
            row = math.prod(shape[1:])
            chunk = -(-rows // self.world)
            start = min(self.rank * chunk, rows)
            length = max(0, min(chunk, rows - start))
            self.pieces.append(Piece(i, shape, chunk, row, offset, start, length))
            offset += chunk * row
        self.numel = offset  # S: elements of one rank's flat shard

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor ``i``'s rows inside this rank's flat shard ``flat`` (a view, its shape)."""
        p = self.pieces[i]
        return flat[p.offset : p.offset + p.length * p.row].view(p.length, *p.shape[1:])

    def pack_own(self, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``out`` (``S`` elements) <- this rank's rows of ``tensors`` (the padding zero)."""
        out.zero_()
        for p, t in zip(self.pieces, tensors, strict=True):
            if p.length:
                self.view(out, p.index).copy_(t.detach()[p.start : p.start + p.length])
        return out

    def _pack_all(self, tensors: Sequence[torch.Tensor | None], like: torch.Tensor,
                  into: torch.Tensor | None = None) -> torch.Tensor:
        """The ``N S`` buffer (``into``'s storage, else a new one) of every rank's rows of
        ``tensors`` (None: zeros)."""
        # every element written once: the rows, else zeros (padding, a None tensor)
        buf = (torch.empty(self.world, self.numel, dtype=like.dtype, device=like.device) if into is None
               else into.view(self.world, self.numel))
        for p, t in zip(self.pieces, tensors, strict=True):
            if p.row == 0:
                continue
            cols = buf[:, p.offset : p.offset + p.chunk * p.row].view(self.world, p.chunk, p.row)
            if t is None:
                cols.zero_()
                continue
            rows = t.detach().reshape(p.shape[0], p.row)
            for j in range(self.world):  # rank j's rows (the last ranks' may be short or none)
                part = rows[j * p.chunk : (j + 1) * p.chunk]
                cols[j, : part.shape[0]].copy_(part)
                cols[j, part.shape[0]:].zero_()
        return buf.view(-1)

    def gather(self, flat: torch.Tensor, outs: Sequence[torch.Tensor], *, group: Any = None,
               counter: CommCounter | None = None) -> None:
        """Every rank's flat shard gathered (one collective) and copied out into ``outs``
        (the whole tensors, in place). On one host through shared memory (:mod:`.shm`): the
        rows are copied out of the other ranks' slots."""
        arena = self._arena(flat, group)
        if arena is not None:
            count_op(counter, "all_gather_into_tensor", nbytes_of(flat))
            slots = arena.slots(self.numel, flat.dtype)
            slots[self.rank].copy_(flat.reshape(-1))
            arena.barrier()
            self._copy_out(slots, outs)
            arena.barrier()
            return
        full = torch.empty(self.world * self.numel, dtype=flat.dtype, device=flat.device)
        all_gather_into_tensor(full, flat, group=group, counter=counter)
        self._copy_out(list(full.view(self.world, self.numel)), outs)

    def _arena(self, like: torch.Tensor, group: Any) -> SyncArena | None:
        """Shared memory for this collective, or None (gloo); the same answer on every rank."""
        if like.device.type != "cpu" or not like.is_contiguous() or self.numel == 0 or world_size(group) != self.world:
            return None
        return sync_arena(group, self.world * self.numel * like.element_size())

    def _copy_out(self, grid: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        """Rank ``j``'s flat shard ``grid[j]``'s rows into the whole tensors ``outs``."""
        for p, out in zip(self.pieces, outs, strict=True):
            if p.row == 0:
                continue
            rows = out.view(p.shape[0], p.row)
            for j in range(self.world):  # rank j's rows straight into place (no staging copy)
                n = max(0, min(p.chunk, p.shape[0] - j * p.chunk))
                if n:
                    rows[j * p.chunk : j * p.chunk + n].copy_(
                        grid[j][p.offset : p.offset + n * p.row].view(n, p.row))

    def reduce_scatter(self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor, *,
                       group: Any = None, counter: CommCounter | None = None,
                       average: bool = True) -> torch.Tensor:
        """``out`` (this rank's ``S`` elements) <- the mean over ranks of ``tensors`` (None:
        zeros), one reduce-scatter of the sum divided by N (``average=False``: the sum, for a
        replicated stage whose losses are already weighted by their rows)."""
        arena = self._arena(out, group)
        if arena is None:
            buf = self._pack_all(tensors, out)
            return reduce_scatter(out, buf, group=group, average=average, counter=counter)
        # On one host: every rank packs into its slot, then sums its own shard over the slots
        # (rank order; on 2 ranks gloo's a + b), the same arithmetic as reduce_scatter's
        slots = arena.slots(self.world * self.numel, out.dtype)
        self._pack_all(tensors, out, into=slots[self.rank])
        count_op(counter, "reduce_scatter", nbytes_of(slots[self.rank]))
        lo, hi = self.rank * self.numel, (self.rank + 1) * self.numel
        arena.barrier()
        sum_in_rank_order([s[lo:hi] for s in slots], out.view(-1))
        arena.barrier()
        if average:
            out.div_(self.world)
        return out
