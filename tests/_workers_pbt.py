"""Helpers for the PopulationBased tests that run inside spawned worker processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from paratrain.models.zoo import mlp

__all__ = ["crashing_mlp"]


def crashing_mlp(
    input_shape: tuple[int, ...], num_classes: int, *, hidden: list[int] | None = None,
    crash_when: str = "", crash_marker: str = "", **kw: Any,
) -> nn.Sequential:
    """The zoo MLP, except that the first build after ``crash_when`` exists kills the
    whole process (a hard crash, no exception), once: ``crash_marker`` records it."""
    if crash_when and os.path.exists(crash_when) and not os.path.exists(crash_marker):
        Path(crash_marker).write_text(f"crashed pid {os.getpid()}\n")
        os._exit(3)
    return mlp(input_shape, num_classes, hidden=hidden, **kw)


def json_ops_worker(ctx: Any) -> dict[str, Any]:
    """Exercise gather_json / broadcast_json on real ranks."""
    from paratrain.comm.collectives import broadcast_json, gather_json

    doc = {"rank": ctx.rank, "payload": "x" * (10 + 1000 * ctx.rank), "f": [0.5, None]}
    gathered = gather_json(doc, group=ctx.group)
    plan = broadcast_json({"from": 0, "nested": {"a": [1, 2.5, "s"]}} if ctx.rank == 0 else None,
                          group=ctx.group)
    empty = broadcast_json("" if ctx.rank == 0 else "ignored", group=ctx.group)
    too_big = None
    try:
        gather_json({"big": "y" * 5000} if ctx.rank == 1 else {}, group=ctx.group, max_bytes=1000)
    except ValueError as e:
        too_big = str(e)
    return {"gathered": gathered, "plan": plan, "empty": empty, "too_big": too_big}
