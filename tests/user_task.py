"""A user's task, written only against the public ``paratrain.Task`` protocol (no paratrain
base class, model or dataset): fit y = sin(3x) + noise with an L1 loss and its own metrics.

Its dataset is a plain map-style ``torch.utils.data.Dataset`` (not a TensorDataset), its
model a plain ``nn.Module``; it is named in job files as ``task.factory =
"user_task:make_task"`` (tests/ is on sys.path, and on every spawned rank's).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset


class Sine(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 1, generator=g) * 2 - 1
        self.y = torch.sin(3 * self.x) + 0.05 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class SineTask:
    name = "sine_l1"
    fitness_metric = "mae"
    fitness_mode: Literal["max", "min"] = "min"
    eval_batch_size = 64

    def __init__(self, hidden: int = 32) -> None:
        self.hidden = hidden

    def datasets(self, seed: int) -> tuple[Dataset[Any], Dataset[Any]]:
        return Sine(256, seed), Sine(128, seed + 1)

    def build_model(self, model_spec: Any, train: Dataset[Any]) -> nn.Module:
        del model_spec, train
        return nn.Sequential(nn.Linear(1, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))

    def loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return (output.float() - batch[1]).abs().mean()

    def eval_batch(self, output: torch.Tensor, batch: Any) -> dict[str, float]:
        err = output.float() - batch[1]
        return {"abs": float(err.abs().sum()), "sq": float(err.pow(2).sum()),
                "count": float(err.numel())}

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["count"], 1.0)
        return {"loss": sums["abs"] / n, "mae": sums["abs"] / n, "rmse": math.sqrt(sums["sq"] / n)}


def make_task(hidden: int = 32) -> SineTask:
    return SineTask(hidden)
