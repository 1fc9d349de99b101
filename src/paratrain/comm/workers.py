"""Resolve a ``RemoteTarget`` (``{"WorkerId": id}`` / ``{"Tag": tag}``) to a worker.

``WorkerId`` = the worker whose id is exactly ``id``; ``Tag`` = the first worker (by
rank) whose tags include ``tag``. An unknown id or tag is a ``ConfigError`` listing the
registered ids (or tags) so the user can fix the job file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config import ConfigError
from .context import WorkerInfo


def _fields(target: Any) -> tuple[str | None, str | None]:
    if isinstance(target, dict):
        return target.get("WorkerId"), target.get("Tag")
    return getattr(target, "WorkerId", None), getattr(target, "Tag", None)


def resolve_target(target: Any, workers: Sequence[WorkerInfo], *, field: str = "target") -> WorkerInfo:
    """The worker ``target`` names; ``field`` is the job path used in error messages."""
    wid, tag = _fields(target)
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
