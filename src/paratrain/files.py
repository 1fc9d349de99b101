"""Deleting only inside a given root: :func:`safe_rmtree` / :func:`safe_unlink`.

Every deletion paratrain makes goes through these (run folders, checkpoints, DataStore
sessions), and each refuses a path that is not strictly inside the root it is given. They
sit on the bottom floor, beside :mod:`paratrain.config`, so that every floor that deletes
(``comm``'s DataStore, ``training``'s run folder, the executors) uses the same check.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["inside", "safe_rmtree", "safe_unlink"]


def inside(path: Path, root: Path) -> bool:
    """``path`` lies strictly below ``root`` (both resolved, so ``..`` and symlinked
    parents are followed)."""
    p, r = path.resolve(), root.resolve()
    return p != r and r in p.parents


def safe_rmtree(path: str | Path, root: str | Path) -> None:
    """Delete ``path`` (a folder tree, a file or a symlink itself) only if it lies
    strictly inside ``root``; anything else is a bug and raises, deleting nothing."""
    p, r = Path(path), Path(root)
    if p.name in ("", ".", "..") or not (p.parent.resolve() == r.resolve() or inside(p.parent, r)):
        raise RuntimeError(f"refusing to delete {p}: it is not inside {r}")
    if p.is_symlink() or p.is_file():
        p.unlink(missing_ok=True)
    elif p.exists():
        shutil.rmtree(p)


def safe_unlink(path: str | Path, root: str | Path) -> None:
    """Delete one file only if it lies strictly inside ``root``."""
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        raise RuntimeError(f"refusing to unlink {p}: it is a folder")
    safe_rmtree(p, root)
