"""Control-plane collectives for population-based training: JSON documents, no pickle.

PBT moves two kinds of small messages per generation: every rank's member results
(fitness, metrics, digests) to rank 0, and rank 0's plan (hyperparameters and sources
of every member) back to everyone. Weights never travel here: members exchange state
through checkpoint files (byte-identical copies).

A document is UTF-8 JSON in a ``uint8`` tensor. ``gather_json`` first all-gathers the
byte lengths (int64), then gathers payloads padded to the longest; ``broadcast_json``
broadcasts the length, then the payload. Lengths are bounded by ``max_bytes`` before any
allocation, and payloads are parsed with ``json.loads`` (DESIGN §6: nothing arriving
over the network is unpickled). ``group=None`` means a single process: the helpers
return their input.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_json", "broadcast_json", "MAX_BYTES"]

MAX_BYTES = 64 * 1024 * 1024


def _encode(obj: Any) -> torch.Tensor:
    raw = json.dumps(obj, allow_nan=True).encode("utf-8")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


def _decode(t: torch.Tensor, n: int) -> Any:
    return json.loads(bytes(t[:n].tolist()).decode("utf-8")) if n else None


def _check(n: int, max_bytes: int) -> None:
    if not 0 <= n <= max_bytes:
        raise ValueError(f"JSON message of {n} bytes is outside [0, {max_bytes}]")


def gather_json(obj: Any, *, group: Any, dst: int = 0, max_bytes: int = MAX_BYTES) -> list[Any] | None:
    """Gather one JSON document per rank to ``dst`` (rank order); ``None`` elsewhere."""
    if group is None:
        return [obj]
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    payload = _encode(obj)
    # Sizes are exchanged before anyone checks them, so an oversize document fails on
    # every rank together instead of leaving the others blocked in a collective.
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64), group=group)
    sizes = [int(x) for x in lengths]
    for n in sizes:
        _check(n, max_bytes)
    width = max(max(sizes), 1)
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    bufs = [torch.zeros(width, dtype=torch.uint8) for _ in range(world)] if rank == dst else None
    dist.gather(padded, gather_list=bufs, dst=dst, group=group)
    if bufs is None:
        return None
    return [_decode(b, n) for b, n in zip(bufs, sizes, strict=True)]


def broadcast_json(obj: Any, *, group: Any, src: int = 0, max_bytes: int = MAX_BYTES) -> Any:
    """``src``'s JSON document on every rank (others pass anything, e.g. ``None``)."""
    if group is None:
        return obj
    rank = dist.get_rank(group)
    payload = _encode(obj) if rank == src else torch.zeros(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.broadcast(length, src=src, group=group)
    n = int(length)
    _check(n, max_bytes)
    buf = payload if rank == src else torch.zeros(max(n, 1), dtype=torch.uint8)
    if n:
        dist.broadcast(buf, src=src, group=group)
    return _decode(buf, n)
