"""Optimizers by name: sgd, adam, adamw; extra spec keys pass through as kwargs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..config import ConfigError
from ..config.job import OptimizerSpec

__all__ = ["OPTIMIZERS", "build_optimizer"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def build_optimizer(
    params: Iterable[Any], spec: OptimizerSpec, **overrides: Any
) -> torch.optim.Optimizer:
    """``spec.name`` with ``lr`` and extra keys (momentum, weight_decay, betas...)."""
    kwargs: dict[str, Any] = {"lr": spec.lr, **spec.kwargs, **overrides}
    if spec.weight_decay is not None and "weight_decay" not in overrides:
        kwargs["weight_decay"] = spec.weight_decay
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    cls = OPTIMIZERS[spec.name]
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError([("train.optimizer", f"{spec.name}: {e}")]) from None
