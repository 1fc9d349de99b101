"""Evaluation: mean cross-entropy and accuracy over a dataset, no gradients."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(
    model: nn.Module, dataset: TensorDataset, *, batch_size: int = 1024,
    device: torch.device | None = None,
) -> dict[str, float]:
    was_training = model.training
    model.eval()
    x_all, y_all = dataset.tensors
    total_loss, correct = 0.0, 0
    for i in range(0, len(y_all), batch_size):
        x, y = x_all[i : i + batch_size], y_all[i : i + batch_size]
        if device is not None:
            x, y = x.to(device), y.to(device)
        out = model(x)
        total_loss += float(nn.functional.cross_entropy(out, y, reduction="sum"))
        correct += int((out.argmax(dim=1) == y).sum())
    model.train(was_training)
    n = max(len(y_all), 1)
    return {"loss": total_loss / n, "accuracy": correct / n}
