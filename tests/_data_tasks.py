"""Tasks for the DataLoader tests and benchmarks (importable on every rank: tests/ is on
sys.path): a map-style dataset with on-the-fly random augmentation, and a stream.

- ``augmented``: y = sin(3x); ``__getitem__`` adds fresh Gaussian noise to x (drawn from
  torch's generator, as a torchvision transform does) and, with ``work > 0``, spends that
  many ~0.1 ms rounds of numpy arithmetic per item (a transform-heavy pipeline);
- ``stream``: an ``IterableDataset`` of items ``(x_j, y_j, j)`` (``j`` the item number, so
  a test can see which items a rank read), ``length`` items or endless; deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset


def _point(j: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor([math.sin(0.7 * j + 0.3)], dtype=torch.float32)
    return x, torch.sin(3 * x)


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, *, noise: float = 0.1, work: int = 0, feature: int = 64) -> None:
        self.n, self.noise, self.work, self.feature = n, noise, work, feature

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _point(int(i))
        x = x + self.noise * torch.randn(1)  # random augmentation, drawn per item
        if self.work:  # a transform-heavy pipeline (decode, crop, colour jitter, ...)
            a = np.full((self.feature, self.feature), float(x), dtype=np.float64)
            for _ in range(self.work):
                a = np.tanh(a @ a.T * 1e-3 + 0.1)
            x = x + 1e-9 * float(a.mean())
        return x, y


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    def __init__(self, length: int | None) -> None:
        self.length = length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        j = 0
        while self.length is None or j < self.length:
            x, y = _point(j)
            yield x, y, torch.tensor(j)
            j += 1


class DataTask:
    name = "data_task"
    fitness_metric = "mse"
    fitness_mode: Literal["max", "min"] = "min"
    eval_batch_size = 64

    def __init__(self, kind: str = "augmented", n: int = 256, length: int | None = None,
                 work: int = 0, hidden: int = 16) -> None:
        self.kind, self.n, self.length, self.work, self.hidden = kind, n, length, work, hidden

    def datasets(self, seed: int) -> tuple[Any, Any]:
        del seed
        if self.kind == "stream":
            return Stream(self.length), Stream(64)  # the test stream is finite
        return Augmented(self.n, work=self.work), Augmented(64, noise=0.0)

    def build_model(self, model_spec: Any, train: Any) -> nn.Module:
        del model_spec, train
        return nn.Sequential(nn.Linear(1, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return (output - batch[1]).pow(2).mean()

    def eval_batch(self, output: torch.Tensor, batch: Any) -> dict[str, float]:
        return {"sq": float((output - batch[1]).pow(2).sum()), "count": float(len(output))}

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        mse = sums.get("sq", 0.0) / max(sums.get("count", 0.0), 1.0)
        return {"loss": mse, "mse": mse}


def make_task(kind: str = "augmented", n: int = 256, length: int | None = None, work: int = 0,
              hidden: int = 16) -> DataTask:
    return DataTask(kind, n, length, work, hidden)
