"""One optimizer step, the same under every strategy: accumulation, precision, clipping,
the learning-rate schedule. A step of :mod:`.loop` over batches ``b_1..b_k`` (``n_i``
examples each, ``N = sum n_i``) runs

    for i in 1..k:   engine.forward_backward(b_i, weight = n_i / N, last = (i == k))
    engine.sync()                                   # the strategy's own combination
    c = min(1, max_norm / (||g||_2 + 1e-6))         # only with train.grad_clip_norm
    g <- c * g;  optimizer.step();  scheduler.step()

so for a loss that is a mean over its batch, ``k`` accumulated batches of ``b`` equal one
batch of ``k * b``. ``||g||`` is the whole model's norm (the engine all-reduces it over
shards). ``bf16`` autocasts forward and loss; parameters, gradients and optimizer state
stay fp32 (no loss scaler: bf16 has fp32's exponent range). The schedule
(:func:`lr_factor`) has Hugging Face's ``get_*_schedule_with_warmup`` shapes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def lr_factor(step: int, *, kind: str, warmup_steps: int, total_steps: int) -> float:
    """The multiplier of the base learning rate at optimizer step ``step`` (0-based):
    ``(s + 1) / W`` in warmup, then with ``p = (s - W) / max(1, T - W)`` constant 1,
    cosine ``(1 + cos(pi p)) / 2`` or linear ``1 - p``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    p = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    if kind == "linear":
        return 1.0 - p
    raise ValueError(f"unknown lr_schedule {kind!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, train: Any,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The job's ``train.lr_schedule`` over ``total_steps`` optimizer steps."""
    kind, warmup = str(train.lr_schedule), int(train.warmup_steps)

    def factor(step: int) -> float:
        return lr_factor(step, kind=kind, warmup_steps=warmup, total_steps=total_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@contextlib.contextmanager
def autocast(precision: str, device: torch.device | str | None) -> Iterator[None]:
    """``torch.autocast`` to bfloat16 for ``precision == "bf16"``; nothing for fp32."""
    if precision != "bf16":
        yield
        return
    kind = torch.device(device).type if device is not None else "cpu"
    with torch.autocast(device_type=kind, dtype=torch.bfloat16):
        yield


def local_grad_sq_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum ||p.grad||^2`` (float64, a 0-d tensor) over ``params`` that have a gradient."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            total += p.grad.detach().double().pow(2).sum().cpu()
    return total


def clip_coefficient(grad_sq_norm: float, max_norm: float) -> float:
    """torch's ``clip_grad_norm_`` coefficient: ``min(1, max_norm / (norm + 1e-6))``."""
    return min(1.0, max_norm / (math.sqrt(max(grad_sq_norm, 0.0)) + 1e-6))


def clip_gradients_(params: Iterable[torch.Tensor], coefficient: float) -> None:
    """Scale every gradient by ``coefficient`` in place (no-op at 1)."""
    if coefficient >= 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.detach().mul_(coefficient)
