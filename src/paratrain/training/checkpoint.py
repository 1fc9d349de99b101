"""Checks before a resume (naming what differs before anything is loaded), and reading one
``torch.save`` file with ``weights_only=True`` (:class:`CheckpointError` names a bad one).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError

MIN_KEEP = 2  # the stores keep this many: a corrupt newest checkpoint has an older fallback


class CheckpointError(RuntimeError):
    """A checkpoint file that exists but cannot be loaded; the message names it."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"checkpoint {path} {reason}")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load one checkpoint file (FileNotFoundError when missing, else :class:`CheckpointError`)."""
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


def _shape(v: Any) -> str:
    return str(tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__


def check_model_state(
    module: torch.nn.Module | Mapping[str, Any], state: Mapping[str, Any], *, source: str | Path,
    field: str = "model",
) -> None:
    """A ConfigError naming every tensor whose name or shape differs; nothing is loaded."""
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


def check_resume_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any], *,
    source: str | Path,
) -> None:
    """Before loading ``state``: :func:`check_model_state`, then a ConfigError when its
    optimizer state is another optimizer's (type, groups, parameters)."""
    check_model_state(module, state["model"], source=source)
    saved_type, mine = state.get("optimizer_type"), type(optimizer).__name__
    groups = state["optimizer"].get("param_groups") if isinstance(state["optimizer"], Mapping) else None
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
        raise ConfigError([("train.optimizer", f"checkpoint {source} does not fit: {problem}; resume "
                                               "with the original optimizer, or start a fresh run with --overwrite")])
