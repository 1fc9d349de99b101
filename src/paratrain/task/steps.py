"""The task-generic loop pieces: gather a batch by indices, evaluation (the optimizer step
is the one loop's :class:`paratrain.training.loop.Trainer`).

No DataLoader: the order is the loop's (``epoch_permutation``), a batch is gathered here.
For a ``TensorDataset`` the batch is ``tuple(t[idx] for t in tensors)``, exactly what the
classification loop always did, so its parameters stay bit-identical.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset, default_collate

from .protocol import Task

__all__ = ["fetch_batch", "evaluate", "DEFAULT_EVAL_BATCH"]

DEFAULT_EVAL_BATCH = 1024


def _as_tuple(batch: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, list | tuple):
        return tuple(batch)
    raise TypeError(f"a dataset item must be a tensor or a tuple of tensors (got {type(batch).__name__})")


def fetch_batch(dataset: Dataset[Any], idx: torch.Tensor,
                device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
    """Examples ``idx`` of ``dataset`` as one batch (a tuple of stacked fields) on ``device``."""
    if isinstance(dataset, TensorDataset):
        batch = tuple(t[idx] for t in dataset.tensors)
    elif callable(getattr(dataset, "get_batch", None)):
        batch = _as_tuple(dataset.get_batch(idx))  # type: ignore[attr-defined]
    else:
        batch = _as_tuple(default_collate([dataset[int(i)] for i in idx]))
    if device is not None:
        batch = tuple(t.to(device) for t in batch)
    return batch


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, dataset: Dataset[Any], *,
             device: torch.device | None = None, batch_size: int | None = None) -> dict[str, float]:
    """The task's metrics over ``dataset``, in order, from summed ``eval_batch`` results."""
    bs = int(batch_size or getattr(task, "eval_batch_size", None) or DEFAULT_EVAL_BATCH)
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    n = len(dataset)  # type: ignore[arg-type]
    try:
        for a in range(0, n, bs):
            batch = fetch_batch(dataset, torch.arange(a, min(a + bs, n)), device)
            for k, v in task.eval_batch(model(batch[0]), batch).items():
                sums[k] = sums.get(k, 0.0) + float(v)
    finally:
        model.train(was_training)
    sums.setdefault("count", 0.0)
    return task.finalize(sums)
