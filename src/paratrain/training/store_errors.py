"""Why a checkpoint save or load failed, in one line a user can act on (:mod:`.stores`):
the OS error of a failed write, or what part of a checkpoint folder is missing or corrupt
(torch.distributed.checkpoint gathers each process's exception in a ``CheckpointException``)."""

from __future__ import annotations

from typing import Any

__all__ = ["Unreadable", "save_reason", "load_reason"]


class Unreadable(RuntimeError):
    """A checkpoint folder that lacks part of what DCP wrote (every process raises it)."""


def save_reason(e: BaseException) -> str:
    """Why a save failed: the OS error (DCP gathers each process's in a CheckpointException)."""
    if isinstance(e, OSError):
        return str(e.strerror or e)
    for failure in _failures(e).values():
        err: Any = failure[0] if isinstance(failure, tuple) else failure
        return str(err.strerror or err) if isinstance(err, OSError) else f"{type(err).__name__}: {err}"
    return str(e)[:300]


def _failures(e: BaseException) -> dict[Any, Any]:
    """A CheckpointException's failures by rank (``{}`` for anything else)."""
    failures = getattr(e, "failures", None)
    return failures if isinstance(failures, dict) else {}


def load_reason(e: BaseException) -> str:
    if isinstance(e, Unreadable):
        return f"is not readable: it {e}"
    for failure in _failures(e).values():
        err: Any = failure[0] if isinstance(failure, tuple) else failure  # DCP's (exception, traceback)
        first = (str(err).strip().splitlines() or [""])[-1]
        return f"is not readable, truncated or corrupt: {type(err).__name__}: {first[:300]}"
    return str(e)[:300]
