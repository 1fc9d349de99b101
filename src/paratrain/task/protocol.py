"""The :class:`Task` protocol: what is trained, independent of how it is spread.

A task says how to build the model, which train/test datasets to use, the loss of a
batch and the metrics of an evaluation. The training loop only calls these methods; any
object that has them is a task (no base class needed).

Batches. Datasets are map-style ``torch.utils.data.Dataset`` objects (``len`` and
``dataset[i]``; arrays are wrapped in a ``TensorDataset``). An item may be a tensor, a
tuple, a dict (what Hugging Face collators give) or any pytree of tensors; a batch is the
items at a list of indices collated into one pytree of the same structure
(:func:`paratrain.task.fetch_batch`: a ``TensorDataset`` is indexed directly, a dataset
with ``get_batch(indices)`` is asked for the whole batch, otherwise the task's optional
``collate_fn(items)`` or ``torch.utils.data.default_collate``), moved to the device as a
whole. The model is called on it by :func:`paratrain.task.call_model`: the task's optional
``model_inputs(batch)`` says how (a dict: keyword arguments, a tuple: positional ones, an
``(args, kwargs)`` pair: both, anything else: the one argument); without it a dict batch is
``model(**batch)``, a tuple batch ``model(batch[0])`` and a tensor batch ``model(batch)``.
``loss`` and ``eval_batch`` get the model's output as it is (a tensor, a Hugging Face
``ModelOutput``, ...) and the whole batch (``batch[1:]`` or ``batch["labels"]`` are the
targets, by convention; the built-in tasks read ``.logits`` and a model's own ``.loss``,
:mod:`paratrain.task.builtin`).

Evaluation is additive: ``eval_batch`` returns *sums* over the batch (floats, including
``"count"``), the loop adds them up over every batch of the test set, and ``finalize``
turns the totals into metrics. Sums can be added in any grouping (per rank, then
all-reduced), so a sharded evaluation gives the same metrics as one pass. ``finalize`` must
return ``"loss"``; the summary reports ``test_<name>`` for every metric it returns.
"""

from __future__ import annotations

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
    1024), ``collate_fn(items) -> batch``, ``model_inputs(batch)`` (the module docstring) and ``reference_metrics(train, test) -> dict[str, float]`` (baselines reported in
    the summary as they are, e.g. the language model's ``bigram_test_loss``).
    """

    fitness_metric: str
    fitness_mode: Literal["max", "min"]

    def datasets(self, seed: int) -> tuple[Dataset[Any], Dataset[Any]]: ...

    def build_model(self, model_spec: Any, train: Dataset[Any]) -> nn.Module: ...

    def loss(self, output: Any, batch: Any) -> torch.Tensor: ...

    def eval_batch(self, output: Any, batch: Any) -> dict[str, float]: ...

    def finalize(self, sums: dict[str, float]) -> dict[str, float]: ...
