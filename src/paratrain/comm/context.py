"""What a worker process knows about itself and its peers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
