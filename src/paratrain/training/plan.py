"""This process's data (:class:`DataPlan`) and the loop's position in it. Replica ``r`` of
``n`` takes ``perm[: (N // n) * n][r::n]`` of :func:`epoch_permutation` (what
``DistributedSampler(shuffle=False, drop_last=True)`` yields over ``perm``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ConfigError
from ..data.loader import IN_PROCESS, Feed, LoaderOptions, MapFeed, StreamFeed, is_stream


def epoch_permutation(n: int, *, seed: int, epoch: int) -> torch.Tensor:
    """A fresh permutation of ``range(n)`` per epoch, a pure function of (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


@dataclass(frozen=True)
class DataPlan:
    """``order(epoch)``: the dataset indices this process walks that epoch, in batches of
    ``batch_size``; a stream is read by rank ``shard[0]`` of ``shard[1]`` as one "epoch" of
    ``max_steps`` steps."""

    dataset: Any
    order: Callable[[int], torch.Tensor]
    examples_per_epoch: int
    batch_size: int
    accumulation: int
    epochs: int
    max_steps: int | None
    device: torch.device | None = None
    loader: LoaderOptions = IN_PROCESS
    shard: tuple[int, int] = (0, 1)

    @classmethod
    def build(cls, *, dataset: Any, order: Callable[[int], torch.Tensor], examples_per_epoch: int,
              batch_size: int, accumulation: int, epochs: int, max_steps: int | None,
              device: torch.device | None = None, loader: LoaderOptions = IN_PROCESS,
              shard: tuple[int, int] = (0, 1)) -> DataPlan:
        """The plan; a stream needs ``train.max_steps``."""
        if is_stream(dataset):
            if max_steps is None:
                raise ConfigError([("train.max_steps", "the training data is a stream (an "
                                    "IterableDataset, no len()): a run over it counts steps, "
                                    "not epochs; set train.max_steps")])
            examples_per_epoch, epochs = max_steps * accumulation * batch_size, 1
        return cls(dataset, order, examples_per_epoch, batch_size, accumulation, epochs,
                   max_steps, device, loader, shard)

    @property
    def stream(self) -> bool:
        return is_stream(self.dataset)

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.examples_per_epoch / self.batch_size)

    @property
    def total_steps(self) -> int:
        total = self.epochs * math.ceil(self.batches_per_epoch / self.accumulation)
        return total if self.max_steps is None else min(total, self.max_steps)


@dataclass
class Position:
    step: int = 0
    epoch: int = 0
    batch: int = 0


def feed_of(plan: DataPlan, task: Any) -> Feed:
    """Where the loop reads ``plan``'s batches (the task's ``collate_fn`` collates items)."""
    from ..task.steps import fetch_batch, to_device

    collate = getattr(task, "collate_fn", None)
    move = functools.partial(to_device, device=plan.device)
    if plan.stream:
        return StreamFeed(plan.dataset, batch_size=plan.batch_size, rank=plan.shard[0],
                          world=plan.shard[1], to_device=move, collate=collate,
                          options=plan.loader, device=plan.device)
    return MapFeed(plan.dataset, order=plan.order, batch_size=plan.batch_size, fetch=fetch_batch,
                   to_device=move, collate=collate, options=plan.loader, device=plan.device,
                   rank=plan.shard[0])
