"""Resume on another layout: a checkpoint by the model's own names, laid out anew.

A checkpoint records each process's tensors under their names in the model, the optimizer
state under its parameters' names (:func:`param_names`) and the run's ``layout``; on another
layout each process reads by name what it holds now (:mod:`.stores`), what cannot carry
over is reset with one :class:`ReshardWarning`, and the data continues after the examples
the old replicas walked (:func:`by_examples`). A *shard spec* (an engine's
``model_shards()``), ``{"shape": whole shape, "slices": [[dim, start, length], ...]}``,
says which part of a model tensor a process holds (slices compose as ``narrow``s).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

Spec = Mapping[str, Any]  # {"shape": [...], "slices": [[dim, start, length], ...]}


class ReshardWarning(UserWarning):
    """A resume onto another layout: what was reset."""


def param_keys(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """``module``'s names of ``optimizer``'s parameters in ``param_groups`` order."""
    by_id = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    out: list[str] = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            local = by_id.get(id(p))
            if local is None:
                raise RuntimeError("an optimizer parameter is not a parameter of the module")
            out.append(local)
    return out


def param_names(module: nn.Module, optimizer: torch.optim.Optimizer,
                names: Mapping[str, str] | None = None) -> list[str]:
    """The model names of ``optimizer``'s parameters in ``param_groups`` order (``names``: own -> model's)."""
    return [names.get(k, k) if names is not None else k for k in param_keys(module, optimizer)]


def take(full: torch.Tensor, spec: Spec | None) -> torch.Tensor:
    """The piece of model tensor ``full`` that ``spec`` says a process holds."""
    if spec is None:
        return full
    for dim, start, length in spec["slices"]:
        full = full.narrow(int(dim), int(start), int(length))
    return full.clone()


def by_examples(old: Mapping[str, Any], new: Mapping[str, Any], *, epoch: int, batch: int,
                per_epoch: int) -> tuple[int, int]:
    """``(epoch, batch)`` on layout ``new`` after the examples the data replicas of layout
    ``old`` (``"replicas"``, 1 when absent: Local, tensor parallel, a pipeline) had walked:
    each took ``batch * batch_size`` of its share of the epoch's permutation."""
    moved = batch * int(old.get("replicas", 1)) // int(new.get("replicas", 1))
    return (epoch + 1, 0) if moved >= per_epoch else (epoch, moved)


def repeated_batches(old: Mapping[str, Any], new: Mapping[str, Any], *, batch: int, per_epoch: int) -> int:
    """Batches (of ``train.batch_size`` rows) the old replicas had walked that the new ones
    walk again after :func:`by_examples`, which rounds down: ``batch * R_old mod R_new``
    (0 when the old position moves to the next epoch)."""
    walked = batch * int(old.get("replicas", 1))
    moved = walked // int(new.get("replicas", 1))
    return 0 if moved >= per_epoch else walked - moved * int(new.get("replicas", 1))
