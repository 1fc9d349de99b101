"""What a worker process knows about itself and its peers, and which worker a
``RemoteTarget`` (``{"WorkerId": id}`` / ``{"Tag": tag}``) names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import ConfigError


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's identity: ``id`` (default ``worker-<rank>``) and capability tags."""

    rank: int
    id: str
    tags: tuple[str, ...] = ()


def default_workers(world_size: int, specs: list[Any] | None = None) -> list[WorkerInfo]:
    """Workers from the job's ``[[workers]]`` table (by rank), padded with defaults."""
    specs = list(specs or [])
    return [WorkerInfo(r, specs[r].id, tuple(specs[r].tags)) if r < len(specs)
            else WorkerInfo(r, f"worker-{r}") for r in range(world_size)]


@dataclass
class WorkerContext:
    """Passed to every worker entry point: ``group`` is the default process group and
    ``store`` the rendezvous store used as the control plane (both ``None`` in one process)."""

    rank: int
    world_size: int
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    group: Any = None
    store: Any = None
    workers: list[WorkerInfo] = field(default_factory=list)
    restart_count: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def worker(self) -> WorkerInfo:
        return self.workers[self.rank]


def resolve_target(target: Any, workers: Sequence[WorkerInfo], *, field: str = "target") -> WorkerInfo:
    """The worker ``target`` names: ``WorkerId`` the worker whose id is exactly ``id``, ``Tag``
    the first worker (by rank) whose tags include ``tag``; an unknown one is a ConfigError
    listing the registered ids (or tags). ``field`` is the job path used in error messages."""
    wid, tag = (target.get(k) if isinstance(target, dict) else getattr(target, k, None)
                for k in ("WorkerId", "Tag"))
    if (wid is None) == (tag is None):
        raise ConfigError([(field, f"target must be exactly one of WorkerId or Tag (got {target!r})")])
    if wid is not None:
        for w in workers:
            if w.id == wid:
                return w
        ids = ", ".join(w.id for w in workers) or "(none)"
        raise ConfigError([(f"{field}.WorkerId", f"no worker with id {wid!r}; registered ids: {ids}")])
    for w in sorted(workers, key=lambda w: w.rank):
        if tag in w.tags:
            return w
    tags = sorted({t for w in workers for t in w.tags})
    shown = ", ".join(tags) if tags else "(no worker has tags)"
    raise ConfigError([(f"{field}.Tag", f"no worker carries tag {tag!r}; registered tags: {shown}")])


def resolve_rank(target: Any, workers: Sequence[WorkerInfo], *, field: str = "target") -> int:
    return resolve_target(target, workers, field=field).rank


def workers_with_tags(workers: Sequence[WorkerInfo], required: Sequence[str]) -> list[WorkerInfo]:
    """Workers whose tags include every tag in ``required`` (all of them when empty)."""
    need = set(required)
    return [w for w in workers if need <= set(w.tags)]
