"""How one stage's messages are routed: each crossing value of a micro-batch goes to, or
comes from, every replica of the peer stage that holds some of its rows.

A value of transfer ``t`` (``src -> dst``) for a micro-batch of ``n`` rows is cut into the
pieces :func:`.replicas.pieces` gives for ``R_src`` sending and ``R_dst`` receiving replicas
(rows ``[lo, hi)`` of replica ``j``'s share going to replica ``k``), each on its own message
slot ``slot_of(t, j, k)``. Unreplicated stages have one piece: the whole value.
"""

from __future__ import annotations

from typing import Any

import torch

from .replicas import pieces, row_bounds
from .values import slot_of

__all__ = ["Routing"]


class Routing:
    """Mixin of :class:`.runtime.StageRuntime`: its sends and receives by rows."""

    transport: Any
    replicas: Any
    replica: int
    num_replicas: int
    _sizes: list[int]
    in_transfers: dict[str, Any]
    out_transfers: list[Any]
    reads: dict[int, list[str]]
    parts: dict[int, Any]
    device: torch.device

    def _is_attr(self, v: str) -> bool:
        raise NotImplementedError

    def _links(self, i: int, t: Any, *, mine_is_src: bool) -> list[tuple[int, int, int, int]]:
        """``(peer physical rank, slot, start, stop)`` of each piece of transfer ``t`` for
        micro-batch ``i`` that this replica sends (``mine_is_src``) or receives, rows
        relative to this replica's own rows."""
        n = self._sizes[i]
        rs, rd = self.replicas.count(t.src), self.replicas.count(t.dst)
        me = self.replica
        base = row_bounds(n, self.num_replicas)[me][0]
        out = []
        for j, k, lo, hi in pieces(n, rs, rd):
            if mine_is_src and j == me:
                out.append((self.replicas.of(t.dst)[k], slot_of(t.index, j, k), lo - base, hi - base))
            elif not mine_is_src and k == me:
                out.append((self.replicas.of(t.src)[j], slot_of(t.index, j, k), lo - base, hi - base))
        return out

    def _send_rows(self, val: torch.Tensor, kind: str, i: int, t: Any, step: int, *, to_src: bool) -> None:
        """Send ``val`` (this replica's rows of a value of transfer ``t``) cut into the rows
        each peer replica holds: activations to ``t.dst``'s replicas, gradients back to
        ``t.src``'s. Cutting by rows needs one row per example: a value of another leading
        size (an exported model's rotary table, shape ``(1, T, d)``) crossing into or out of
        a replicated stage is a ValueError naming it."""
        if self.replicas.count(t.src) > 1 or self.replicas.count(t.dst) > 1:
            lo, hi = row_bounds(self._sizes[i], self.num_replicas)[self.replica]
            if val.dim() == 0 or val.shape[0] != hi - lo:
                raise ValueError(
                    f"model-parallel value {t.value!r} of shape {tuple(val.shape)} crosses into or "
                    f"out of a replicated stage but is not one row per example ({hi - lo} rows "
                    f"here): a replicated stage cuts what it reads and sends by rows; do not "
                    f"replicate that stage, or place the nodes that make and read it together")
        for peer, slot, lo, hi in self._links(i, t, mine_is_src=not to_src):
            self.transport.send(val[lo:hi], dst=peer, key=(kind, i, slot), step=step, rows=hi - lo)

    def _recv_rows(self, kind: str, i: int, t: Any, step: int, *, from_src: bool) -> torch.Tensor:
        parts = [self.transport.recv(src=peer, key=(kind, i, slot), step=step, rows=hi - lo)
                 for peer, slot, lo, hi in self._links(i, t, mine_is_src=not from_src)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(self.device)

    def _recv_specs(self, kind: str, i: int, s: int) -> list[tuple[int, tuple[str, int, int], int]]:
        """``(src, key, rows)`` of the messages action ``(kind, i, s)`` waits for."""
        out: list[tuple[int, tuple[str, int, int], int]] = []
        if kind == "F":
            for v in self.reads[s]:
                t = self.in_transfers.get(v)
                if t is not None and not self._is_attr(v):
                    out += [(peer, ("act", i, slot), hi - lo)
                            for peer, slot, lo, hi in self._links(i, t, mine_is_src=False)]
        elif kind == "B":  # a W waits for nothing
            for v in self.parts[s].outputs:
                for t in self.out_transfers:
                    if t.value == v:
                        out += [(peer, ("grad", i, slot), hi - lo)
                                for peer, slot, lo, hi in self._links(i, t, mine_is_src=True)]
        return out
