"""The :class:`Task` protocol: what is trained, independent of how it is spread.

A task says how to build the model, which train/test datasets to use, the loss of a
batch and the metrics of an evaluation. The training loop only calls these methods; any
object that has them is a task (no base class needed).

Batches. Datasets are map-style ``torch.utils.data.Dataset`` objects (``len`` and
``dataset[i]``; arrays are wrapped in a ``TensorDataset``). A batch is the tuple of the
dataset's item fields stacked over a list of indices (``torch.utils.data.default_collate``),
gathered without a DataLoader (:func:`paratrain.task.fetch_batch`: a ``TensorDataset`` is
indexed directly, a dataset with a ``get_batch(indices)`` method is asked for the whole
batch at once). The model is called on ``batch[0]``; ``loss`` and ``eval_batch`` get the
model's output and the whole batch (so ``batch[1:]`` are the targets, by convention).

Evaluation is additive: ``eval_batch`` returns *sums* over the batch (floats, including
``"count"``), the loop adds them up over every batch of the test set, and ``finalize``
turns the totals into metrics. Sums can be added in any grouping (per rank, then
all-reduced), so a sharded evaluation gives the same metrics as one pass. ``finalize`` must
return ``"loss"``; the summary reports ``test_<name>`` for every metric it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset

__all__ = ["Task"]


@runtime_checkable
class Task(Protocol):
    """What is trained. Required members:

    - ``fitness_metric``: the metric PBT and ``target_*`` options read (a key of
      ``finalize``'s result), and ``fitness_mode``: ``"max"`` or ``"min"``.
    - ``datasets(seed)``: ``(train, test)`` map-style datasets (deterministic in ``seed``).
    - ``build_model(model_spec, train)``: the ``nn.Module`` to train; ``model_spec`` is the
      job's ``[model]`` section (:class:`~paratrain.config.job.ModelSpec`; e.g. pass it to
      :func:`paratrain.models.build_model`), ``train`` the training set to size it from.
    - ``loss(output, batch)``: the scalar training loss of a batch (a mean over its examples).
    - ``eval_batch(output, batch)``: additive sums over the batch, including ``"count"``.
    - ``finalize(sums)``: the metrics (``"loss"`` among them) from summed ``eval_batch``
      results.

    Optional: ``name`` (str), ``eval_batch_size`` (examples per evaluation batch, default
    1024) and ``reference_metrics(train, test) -> dict[str, float]`` (baselines reported in
    the summary as they are, e.g. the language model's ``bigram_test_loss``).
    """

    fitness_metric: str
    fitness_mode: Literal["max", "min"]

    def datasets(self, seed: int) -> tuple[Dataset[Any], Dataset[Any]]: ...

    def build_model(self, model_spec: Any, train: Dataset[Any]) -> nn.Module: ...

    def loss(self, output: Any, batch: Sequence[torch.Tensor]) -> torch.Tensor: ...

    def eval_batch(self, output: Any, batch: Sequence[torch.Tensor]) -> dict[str, float]: ...

    def finalize(self, sums: dict[str, float]) -> dict[str, float]: ...
