"""Optimizers by name: sgd, adam, adamw; extra spec keys pass through as kwargs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..config import ConfigError
from ..config.job import OptimizerSpec

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


@contextlib.contextmanager
def _without_compiler_import() -> Iterator[None]:
    """``Optimizer.add_param_group`` is wrapped in ``torch._disable_dynamo``, whose first call
    imports ``torch._dynamo`` (about 1.3 s of CPU). For the block the wrapper finds its cached
    target set (the plain method), as after a first call; unset again afterwards."""
    fn = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
    if fn is None or getattr(fn, "__dynamo_disable", None) is not None:
        yield
        return
    fn.__dynamo_disable = fn
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            del fn.__dynamo_disable


def check_optimizer(params: Iterable[Any], spec: OptimizerSpec) -> None:
    """Build ``spec``'s optimizer over ``params`` and discard it, without importing torch's compiler."""
    with _without_compiler_import():
        build_optimizer(params, spec)
