"""The :class:`Task` protocol: what is trained, independent of how it is spread. Evaluation
is additive: ``eval_batch`` returns *sums* (``"count"`` among them), added over batches and
ranks, and ``finalize`` turns the totals into metrics, so a sharded evaluation equals one pass.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset


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
