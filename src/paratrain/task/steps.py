"""The :class:`Task` protocol (what is trained, independent of how it is spread) and the
task-generic loop pieces: a batch by indices (a ``TensorDataset``'s ``t[idx]``, a dataset's
``get_batch``, else the items collated; a top-level list becomes a tuple), a batch into the
model, evaluation. Evaluation is additive: ``eval_batch`` returns *sums* (``"count"`` among
them), added over batches and ranks, and ``finalize`` turns the totals into metrics, so a
sharded evaluation equals one pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.data import Dataset, TensorDataset, default_collate

from ..data.loader import is_stream, stream_batches


@runtime_checkable
class Task(Protocol):
    """What is trained: ``fitness_metric`` (a key of ``finalize``'s result, read by PBT and
    ``target_*``) and ``fitness_mode`` (``"max"``/``"min"``); ``datasets(seed)`` ->
    ``(train, test)``; ``build_model(model_spec, train)``; ``loss(output, batch)`` (a mean
    over the batch); ``eval_batch(output, batch)`` (sums); ``finalize(sums)`` (with
    ``"loss"``). Optional: ``name``, ``eval_batch_size`` (default 1024), ``collate_fn(items)``,
    ``model_inputs(batch)`` (:func:`paratrain.task.model_args`) and
    ``reference_metrics(train, test)`` (baselines for the summary, e.g. ``bigram_test_loss``).
    """

    fitness_metric: str
    fitness_mode: Literal["max", "min"]

    def datasets(self, seed: int) -> tuple[Dataset[Any], Dataset[Any]]: ...

    def build_model(self, model_spec: Any, train: Dataset[Any]) -> nn.Module: ...

    def loss(self, output: Any, batch: Any) -> torch.Tensor: ...

    def eval_batch(self, output: Any, batch: Any) -> dict[str, float]: ...

    def finalize(self, sums: dict[str, float]) -> dict[str, float]: ...


DEFAULT_EVAL_BATCH = 1024


def _top_tuple(batch: Any) -> Any:
    return tuple(batch) if type(batch) is list else batch


def to_device(batch: Any, device: torch.device | None) -> Any:
    """``batch`` with every tensor leaf on ``device`` (the structure kept; None: as it is)."""
    if device is None:
        return batch
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)


def fetch_batch(dataset: Dataset[Any], idx: torch.Tensor, device: torch.device | None = None, *,
                collate: Callable[[list[Any]], Any] | None = None) -> Any:
    """Examples ``idx`` of ``dataset`` as one batch (module docstring) on ``device``."""
    if isinstance(dataset, TensorDataset):
        batch: Any = tuple(t[idx] for t in dataset.tensors)
    elif callable(getattr(dataset, "get_batch", None)):
        batch = _top_tuple(dataset.get_batch(idx))  # type: ignore[attr-defined]
    else:
        items = [dataset[int(i)] for i in idx]
        batch = _top_tuple((collate or default_collate)(items))
    return to_device(batch, device)


def batch_rows(batch: Any) -> int:
    """The leading size of ``batch``'s first tensor leaf (1 for a 0-dim tensor or none)."""
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            return int(leaf.shape[0]) if leaf.dim() > 0 else 1
    return 1


def model_args(task: Any, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` the model is called with on ``batch``: the task's
    ``model_inputs(batch)`` (a dict: keywords; a tuple: positional; an ``(args, kwargs)``
    pair: both; else one argument), else ``model(**batch)`` for a dict,
    ``model(batch[0])`` for a tuple or list, ``model(batch)`` for a tensor."""
    hook = getattr(task, "model_inputs", None)
    if callable(hook):
        got = hook(batch)
        if (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], tuple)
                and isinstance(got[1], Mapping)):
            return got[0], dict(got[1])
        if isinstance(got, Mapping):
            return (), dict(got)
        if isinstance(got, tuple):
            return got, {}
        return (got,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, tuple | list):
        if not batch:
            raise ValueError("an empty batch has no field to feed the model")
        return (batch[0],), {}
    return (batch,), {}


def example_args(task: Any, train: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The model's ``(args, kwargs)`` on the first two training examples (None: no data)."""
    if len(train) == 0:
        return None
    batch = fetch_batch(train, torch.arange(min(2, len(train))), torch.device("cpu"),
                        collate=getattr(task, "collate_fn", None))
    return model_args(task, batch)


def call_model(task: Any, model: nn.Module | Callable[..., Any], batch: Any) -> Any:
    """The model's output on ``batch``: ``model(*args, **kwargs)`` of :func:`model_args`."""
    args, kwargs = model_args(task, batch)
    return model(*args, **kwargs)


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, dataset: Dataset[Any], *,
             device: torch.device | None = None, batch_size: int | None = None) -> dict[str, float]:
    """The task's metrics over ``dataset`` from summed ``eval_batch`` results (a stream must end)."""
    bs = int(batch_size or getattr(task, "eval_batch_size", None) or DEFAULT_EVAL_BATCH)
    collate = getattr(task, "collate_fn", None)
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    if is_stream(dataset):  # a finite iterable test set, read to its end
        batches: Any = (to_device(b, device) for b in stream_batches(dataset, bs, collate))
    else:
        n = len(dataset)  # type: ignore[arg-type]
        batches = (fetch_batch(dataset, torch.arange(a, min(a + bs, n)), device, collate=collate)
                   for a in range(0, n, bs))
    try:
        for batch in batches:
            for k, v in task.eval_batch(call_model(task, model, batch), batch).items():
                sums[k] = sums.get(k, 0.0) + float(v)
    finally:
        model.train(was_training)
    sums.setdefault("count", 0.0)
    return task.finalize(sums)
