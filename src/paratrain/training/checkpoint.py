"""Atomic checkpoint files: write to a temp file in the same folder, fsync, ``os.replace``.

These are the ``torch.save`` files of Federated's server and workers and of
PopulationBased; the one loop's stores write torch.distributed.checkpoint folders
(:mod:`.stores`) and use only :data:`MIN_KEEP` and the model/optimizer checks from here.

Loading uses ``torch.load(weights_only=True)``: a checkpoint can hold tensors,
containers and plain numbers, never arbitrary pickled objects. A checkpoint that cannot
be read (empty, truncated, garbage) raises :class:`CheckpointError` naming the file and
what is wrong; :func:`load_latest` then falls back to the newest readable older one with
a warning (:func:`prune` always keeps at least two), and when none is readable raises a
ConfigError naming every file. :func:`check_model_state` and
:func:`check_optimizer_state` name what differs when a resumed job's model or optimizer
does not match the checkpoint, before anything is loaded.

A process killed during a save leaves its temp file (``.ckpt-<step>.pt.XXXXXXXX``, a
whole checkpoint's size) behind. Only one process ever writes into a checkpoint folder,
so any such file found there when that process saves, prunes or resumes is stale:
:func:`remove_stale_temps` deletes exactly those (our own temp-name pattern, in that one
folder, never anything else).
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from .faults import maybe_kill_in_save
from .rundir import disk_error, safe_unlink

__all__ = [
    "CheckpointError", "check_resume_state", "save_checkpoint", "load_checkpoint", "load_latest", "latest", "checkpoints", "checkpoint_path",
    "prune", "check_model_state", "check_optimizer_state", "MIN_KEEP", "remove_stale_temps",
]

MIN_KEEP = 2  # prune never keeps fewer: a corrupt newest checkpoint has an older fallback


class CheckpointError(RuntimeError):
    """A checkpoint file that exists but cannot be loaded; the message names it."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"checkpoint {path} {reason}")

_PATTERN = re.compile(r"^ckpt-(\d{9})\.pt$")
# A step-numbered checkpoint file (ckpt-<step>.pt, PBT's population-<g>.pt) and the temp
# name save_checkpoint gives it while writing: mkstemp's prefix "." + name + "." and its
# 8 random characters.
_STEP_FILE = re.compile(r"^[a-z]+-\d{6,9}\.pt$")
_TEMP = re.compile(r"^\.[a-z]+-\d{6,9}\.pt\.[a-z0-9_]{8}$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:09d}.pt"


def remove_stale_temps(directory: str | Path) -> list[Path]:
    """Delete the temp files a killed :func:`save_checkpoint` left in ``directory`` (only
    names of our temp pattern, only files directly in that folder); returns them.

    Call it only from the one process that writes checkpoints into ``directory``: a temp
    file there is then never a save still in progress."""
    d = Path(directory)
    if not d.is_dir():
        return []
    stale = [p for p in d.iterdir() if _TEMP.match(p.name) and p.is_file() and not p.is_symlink()]
    for p in stale:
        try:
            safe_unlink(p, d)
        except OSError as e:
            raise disk_error(p, e, "remove the stale temp file") from None
    return stale


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if _STEP_FILE.match(path.name):
            remove_stale_temps(path.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    except OSError as e:
        raise disk_error(path, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        maybe_kill_in_save(path)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise disk_error(path, e) from None
        if isinstance(e, RuntimeError) and "writ" in str(e).lower():  # torch's stream writer
            raise ConfigError([("run.output_dir", f"cannot write {path}: {str(e).splitlines()[0]}")]) from None
        raise
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load one checkpoint. A missing file raises FileNotFoundError; one that cannot be
    loaded raises :class:`CheckpointError` naming it and saying what is wrong."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(path, "is empty (0 bytes)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
        reason = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(path, (f"({size} bytes) is not a readable checkpoint, truncated "
                                     f"or corrupt: {type(e).__name__}: {reason}")) from None
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not a checkpoint dict")
    return state


def checkpoints(directory: str | Path) -> list[Path]:
    """Every ``ckpt-<step>.pt`` in ``directory``, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _PATTERN.match(p.name))


def load_latest(
    directory: str | Path, *, candidates: list[Path] | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """``(path, state)`` of the newest readable checkpoint in ``directory`` (or of
    ``candidates``, oldest first), None when there is none. An unreadable newer one is
    skipped with a warning naming it; when none is readable, a ConfigError names them."""
    if candidates is None:
        remove_stale_temps(directory)
    found = checkpoints(directory) if candidates is None else list(candidates)
    bad: list[str] = []
    for p in reversed(found):
        try:
            return p, load_checkpoint(p)
        except (CheckpointError, OSError) as e:
            msg = str(e) if isinstance(e, CheckpointError) else f"cannot read {p}: {e.strerror or e}"
            bad.append(msg)
            if len(bad) < len(found):
                warnings.warn(f"skipping checkpoint: {msg}; falling back to the previous one",
                              RuntimeWarning, stacklevel=2)
    if bad:
        raise ConfigError([("checkpoint", f"no readable checkpoint in {directory}: {'; '.join(bad)}")])
    return None


def _shape(v: Any) -> str:
    return str(tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__


def check_model_state(
    module: torch.nn.Module | Mapping[str, Any], state: Mapping[str, Any], *, source: str | Path,
    field: str = "model",
) -> None:
    """A ConfigError naming every tensor whose name or shape differs between ``state``
    (from checkpoint ``source``) and ``module`` (or its state dict); nothing is loaded."""
    own = module.state_dict() if isinstance(module, torch.nn.Module) else module
    problems: list[str] = []
    for k, v in own.items():
        if k not in state:
            problems.append(f"{k} {_shape(v)} is not in the checkpoint")
        elif _shape(state[k]) != _shape(v):
            problems.append(f"{k}: checkpoint {_shape(state[k])}, model {_shape(v)}")
    problems += [f"{k} {_shape(state[k])} is not in the model" for k in state if k not in own]
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise ConfigError([(field, (
            f"checkpoint {source} does not fit this job's model: {'; '.join(problems[:6])}{more}; "
            "resume with the original model, or start a fresh run with --overwrite"))])


def check_optimizer_state(
    optimizer: torch.optim.Optimizer, state: Mapping[str, Any], *, source: str | Path,
    saved_type: str | None = None, field: str = "train.optimizer",
) -> None:
    """A ConfigError when ``state`` is another optimizer's (type, groups, parameters)."""
    mine = type(optimizer).__name__
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    problem = None
    if saved_type is not None and saved_type != mine:
        problem = f"it holds a {saved_type} optimizer state; this job's optimizer is {mine}"
    elif not isinstance(groups, list):
        problem = "it holds no optimizer param_groups"
    elif saved_type is None and groups and ("betas" in groups[0]) != ("betas" in optimizer.param_groups[0]):
        problem = f"its optimizer state is not {mine}'s"
    elif len(groups) != len(optimizer.param_groups) or any(
        len(g.get("params", [])) != len(o["params"]) for g, o in zip(groups, optimizer.param_groups, strict=False)
    ):
        saved = [len(g.get("params", [])) for g in groups]
        problem = (f"its optimizer has parameter groups of sizes {saved}; this job's has "
                   f"{[len(o['params']) for o in optimizer.param_groups]}")
    if problem is not None:
        raise ConfigError([(field, f"checkpoint {source} does not fit: {problem}; resume with the "
                                   "original optimizer, or start a fresh run with --overwrite")])


def check_resume_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any], *,
    source: str | Path,
) -> None:
    """Both checks a resume makes before loading ``state`` (a checkpoint with ``model``,
    ``optimizer`` and optionally ``optimizer_type``): a ConfigError names what differs."""
    check_model_state(module, state["model"], source=source)
    check_optimizer_state(optimizer, state["optimizer"], source=source,
                          saved_type=state.get("optimizer_type"))


def latest(directory: str | Path) -> Path | None:
    """The newest ``ckpt-<step>.pt`` in ``directory`` (by step), or None."""
    found = checkpoints(directory)
    return found[-1] if found else None


def prune(directory: str | Path, keep: int = MIN_KEEP) -> None:
    """Delete all but the newest ``keep`` (at least :data:`MIN_KEEP`) checkpoints."""
    if keep < MIN_KEEP:
        raise ValueError(f"prune keeps at least {MIN_KEEP} checkpoints (got keep={keep})")
    d = Path(directory)
    remove_stale_temps(d)
    for p in checkpoints(d)[:-keep]:
        safe_unlink(p, d)
