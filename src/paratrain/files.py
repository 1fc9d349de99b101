"""A run folder's files on the bottom floor, used by every floor that writes or deletes.

Deleting only strictly inside a given root (:func:`safe_rmtree`; any other path is a bug and
raises). Writing whole or not at all (:func:`write_atomic`), so a crash or a power cut leaves
the old file or the new one, never a torn one. Which checkpoint a run resumes from
(:func:`newest_checkpoint`, by names only): the stores' DCP folders ``checkpoints/step-<n>/``
(``layout.json`` names the store's ``kind``), and earlier versions' files (``ckpt-<step>.pt``,
``population-<generation>.pt``, ``<prefix>-rank<r>/`` with ``<prefix>-complete.json``),
recognised so that a resume says it does not read them and never silently starts fresh.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DCP_FOLDER = "step-{:09d}"  # one torch.distributed.checkpoint folder of the one loop's stores


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


def fsync_folder(folder: str | Path) -> None:
    """fsync a folder, so that a rename or a new entry in it survives a power cut (a file
    system that cannot open or sync a folder, as on Windows, is left to its own order)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # EINVAL/EBADF: this file system does not sync folders; nothing to wait for
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | Path, fill: Callable[[Path], object], *, durable: bool = True) -> Path:
    """Write ``path`` whole or not at all: ``fill(tmp)`` writes a temp file beside it, which
    is fsynced, ``os.replace``d onto ``path``, and the folder fsynced; on any error the temp
    file is removed. ``durable=False`` skips both fsyncs, for values consumed at once that
    never outlive the run (ModelParallel's activations): a reader still sees all or nothing."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fill(tmp)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_folder(path.parent)
    return path


def write_bytes(path: str | Path, data: bytes, *, durable: bool = True) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_bytes(data), durable=durable)


def write_text(path: str | Path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, doc: Any, **dumps: Any) -> Path:
    return write_text(path, json.dumps(doc, **dumps))


_LOCAL = re.compile(r"^ckpt-(\d{9})\.pt$")
_POPULATION = re.compile(r"^population-(\d{6})\.pt$")
_MARKER = re.compile(r"^([a-z]+)-complete\.json$")
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_UNITS = {"fed": "round", "pbt": "generation", "population": "generation"}


def step_folders(checkpoints: str | Path) -> list[Path]:
    """The complete DCP step folders in ``checkpoints`` (renamed from their temp name,
    holding ``layout.json``), oldest first."""
    d = Path(checkpoints)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _STEP_DIR.match(p.name) and (p / "layout.json").is_file())


def _step_doc(folder: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((folder / "layout.json").read_text())
        return doc if isinstance(doc, dict) and isinstance(doc.get("kind"), str) else None
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class FoundCheckpoint:
    """A complete checkpoint: ``kind`` is ``"local"``, ``"population"``, a per-process
    prefix (``"dp"``, ...) or a DCP store's kind; ``path`` the file, marker or folder
    (``doc``: the marker's or ``layout.json``'s contents)."""

    kind: str
    step: int
    path: Path
    doc: dict[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        """``step 40`` in the run's own unit (Federated rounds, PopulationBased generations)."""
        return f"{_UNITS.get(self.kind, 'step')} {self.step}"

    def where_in(self, strategy: str | None) -> str:
        """:attr:`where`; an earlier version's Federated server file (``ckpt-<round>.pt``,
        the Local file layout) held a round, not a step."""
        if strategy == "Federated" and self.kind == "local":
            return f"round {self.step}"
        return self.where

    def describe(self) -> str:
        """Which layout wrote it, for messages."""
        if self.kind in ("local", "population"):
            return f"{self.path.name} ({self.where})"
        shape = ", ".join(f"{k}={v}" for k, v in self.doc.items() if k not in ("step", "kind"))
        return f"{self.path.name} ({self.where}; {shape})"


def newest_checkpoint(run_dir: str | Path) -> FoundCheckpoint | None:
    """The newest complete checkpoint of any layout in ``run_dir`` (highest step, then the
    most recently written), None when there is none. A marker that cannot be read as
    ``{"step": int, ...}`` is skipped (the layout's folders then hold no complete step)."""
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return None
    found: list[tuple[int, int, FoundCheckpoint]] = []
    newest: dict[str, tuple[int, Path]] = {}
    for p in d.iterdir():
        m = _LOCAL.match(p.name) or _POPULATION.match(p.name)
        if m is not None and p.is_file():
            kind = "local" if p.name.startswith("ckpt-") else "population"
            if int(m.group(1)) >= newest.get(kind, (-1, p))[0]:
                newest[kind] = (int(m.group(1)), p)
        elif (mk := _MARKER.match(p.name)) is not None:
            try:
                doc = json.loads(p.read_text())
                step = int(doc["step"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            found.append((step, _mtime(p), FoundCheckpoint(mk.group(1), step, p, dict(doc))))
    for p in reversed(step_folders(d)):  # the newest whose layout.json reads
        doc = _step_doc(p)
        if doc is not None:
            found.append((int(p.name[5:]), _mtime(p), FoundCheckpoint(doc["kind"], int(p.name[5:]), p,
                                                                      doc)))
            break
    for kind, (step, p) in newest.items():
        found.append((step, _mtime(p), FoundCheckpoint(kind, step, p)))
    return max(found, key=lambda f: (f[0], f[1]))[2] if found else None


def _mtime(p: Path) -> int:
    try:
        return p.stat().st_mtime_ns
    except OSError:
        return 0
