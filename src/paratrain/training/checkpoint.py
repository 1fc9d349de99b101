"""Atomic checkpoints: write to a temp file in the same folder, fsync, ``os.replace``.

Loading uses ``torch.load(weights_only=True)``: a checkpoint can hold tensors,
containers and plain numbers, never arbitrary pickled objects.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_checkpoint", "load_checkpoint", "latest", "checkpoint_path", "prune"]

_PATTERN = re.compile(r"^ckpt-(\d{9})\.pt$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:09d}.pt"


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(Path(path), map_location="cpu", weights_only=True)
    return state


def latest(directory: str | Path) -> Path | None:
    """The newest ``ckpt-<step>.pt`` in ``directory`` (by step), or None."""
    d = Path(directory)
    if not d.is_dir():
        return None
    found = sorted(p for p in d.iterdir() if _PATTERN.match(p.name))
    return found[-1] if found else None


def prune(directory: str | Path, keep: int = 2) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    d = Path(directory)
    found = sorted(p for p in d.iterdir() if _PATTERN.match(p.name))
    for p in found[:-keep]:
        p.unlink(missing_ok=True)
