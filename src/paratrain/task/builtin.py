"""The built-in tasks (``[task] name = ...``): classification, regression, language_model.

- ``classification`` (default): cross-entropy over class logits ``[B, C]`` and int64 labels;
  metrics ``loss`` (mean cross-entropy) and ``accuracy``; fitness ``accuracy`` (max).
- ``regression``: mean squared error of outputs ``[B, k]`` against float targets ``[B, k]``
  (mean over every element); metrics ``loss`` = ``mse`` and ``r2`` (the coefficient of
  determination per target column, averaged: scikit-learn's ``r2_score``), computed from the
  sums ``sse_j``, ``sum y_j``, ``sum y_j^2`` and ``count``; fitness ``mse`` (min). Data: a
  regression set (``diabetes``) or a ``data.factory``.
- ``language_model``: next-token cross-entropy over blocks, logits ``[B, T, V]`` against
  ids ``[B, T]``, averaged over every token; metrics ``loss`` (nats per token),
  ``perplexity = exp(loss)`` and ``bits_per_token = loss / ln 2``; fitness ``loss`` (min).
  Data: the ``shakespeare`` corpus (``task.block_size``, ``task.stride``; ``[data]
  test_every``) or a ``data.factory`` returning ``(train, test)`` datasets of ``(x, y)``
  id blocks. Model: ``gpt`` or a ``model.factory``. The summary also reports
  ``bigram_test_loss``: a bigram model (counts of consecutive pairs of the training ids,
  add-``alpha`` smoothed, ``alpha = 1``) scored on the same test examples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ..config import ConfigError
from ..config.job import DataSpec, JobConfig, ModelSpec, TaskSpec
from ..data.datasets import CORPORA, REGRESSION_DATASETS, DataBundle, load_data
from ..models import build_model
from .steps import fetch_batch

__all__ = ["ClassificationTask", "RegressionTask", "LanguageModelTask", "bigram_loss", "TASKS"]


def _tensors(ds: Dataset[Any], what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(ds, TensorDataset) or len(ds.tensors) != 2:
        raise ConfigError([("data", f"{what} needs (features, targets) arrays (a TensorDataset "
                                    f"of two tensors; got {type(ds).__name__})")])
    return ds.tensors[0], ds.tensors[1]


class ClassificationTask:
    """Cross-entropy classification over the job's ``[data]`` (see the module docstring)."""

    name = "classification"
    fitness_metric = "accuracy"
    fitness_mode: Literal["max", "min"] = "max"

    def __init__(self, data: DataSpec) -> None:
        self.data = data
        self.bundle: DataBundle | None = None

    def datasets(self, seed: int) -> tuple[Dataset[Any], Dataset[Any]]:
        if self.data.name in REGRESSION_DATASETS:
            raise ConfigError([("task.name", f"data {self.data.name!r} has real-valued targets: "
                                             "set task.name = 'regression'")])
        if self.data.name in CORPORA:
            raise ConfigError([("task.name", f"data {self.data.name!r} is a text corpus: set "
                                             "task.name = 'language_model'")])
        self.bundle = load_data(self.data, seed=seed)
        _, y = _tensors(self.bundle.train, "classification")
        if y.is_floating_point():
            raise ConfigError([("task.name", "classification needs integer class labels (the "
                                             "data has real-valued targets): set task.name = "
                                             "'regression'")])
        return self.bundle.train, self.bundle.test

    def build_model(self, model_spec: ModelSpec, train: Dataset[Any]) -> nn.Module:
        if self.bundle is not None and train is self.bundle.train:
            shape, classes = self.bundle.input_shape, self.bundle.num_classes
        else:
            x, y = _tensors(train, "classification")
            shape, classes = tuple(x.shape[1:]), int(y.max()) + 1 if len(y) else 1
        return build_model(model_spec, input_shape=shape, num_classes=classes)

    def loss(self, output: torch.Tensor, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(output, batch[1])

    def eval_batch(self, output: torch.Tensor, batch: Sequence[torch.Tensor]) -> dict[str, float]:
        y = batch[1]
        return {"loss_sum": float(nn.functional.cross_entropy(output, y, reduction="sum")),
                "correct": int((output.argmax(dim=1) == y).sum()), "count": len(y)}

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums.get("count", 0), 1)
        return {"loss": sums.get("loss_sum", 0.0) / n, "accuracy": sums.get("correct", 0) / n}


class RegressionTask:
    """Mean-squared-error regression over the job's ``[data]``."""

    name = "regression"
    fitness_metric = "mse"
    fitness_mode: Literal["max", "min"] = "min"

    def __init__(self, data: DataSpec) -> None:
        self.data = data

    def datasets(self, seed: int) -> tuple[Dataset[Any], Dataset[Any]]:
        if self.data.factory is None and self.data.name not in REGRESSION_DATASETS:
            raise ConfigError([("data.name", f"regression needs real-valued targets; "
                                             f"{self.data.name!r} is not a regression set (valid: "
                                             f"{', '.join(sorted(REGRESSION_DATASETS))}, or a "
                                             "data.factory)")])
        bundle = load_data(self.data, seed=seed, regression=True)
        for part in (bundle.train, bundle.test):
            _, y = _tensors(part, "regression")
            if not y.is_floating_point():
                raise ConfigError([("data", "regression needs real-valued (float) targets")])
        return bundle.train, bundle.test

    def build_model(self, model_spec: ModelSpec, train: Dataset[Any]) -> nn.Module:
        x, y = _tensors(train, "regression")
        outputs = int(y.shape[1]) if y.dim() == 2 else 1
        return build_model(model_spec, input_shape=tuple(x.shape[1:]), num_classes=outputs)

    @staticmethod
    def _pair(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = target.reshape(len(target), -1)
        if output.numel() != y.numel():
            raise ValueError(f"regression: model output of shape {tuple(output.shape)} does not "
                             f"match targets of shape {tuple(target.shape)}")
        return output.reshape(y.shape), y

    def loss(self, output: torch.Tensor, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        out, y = self._pair(output, batch[1])
        return nn.functional.mse_loss(out, y)

    def eval_batch(self, output: torch.Tensor, batch: Sequence[torch.Tensor]) -> dict[str, float]:
        out, y = self._pair(output, batch[1])
        out, y = out.double(), y.double()
        sse, sy, syy = ((out - y) ** 2).sum(0), y.sum(0), (y * y).sum(0)
        sums: dict[str, float] = {"count": len(y)}
        for j in range(y.shape[1]):
            sums[f"sse_{j}"], sums[f"sy_{j}"], sums[f"syy_{j}"] = float(sse[j]), float(sy[j]), float(syy[j])
        return sums

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums.get("count", 0)
        k = sum(1 for key in sums if key.startswith("sse_"))
        if n <= 0 or k == 0:
            return {"loss": math.nan, "mse": math.nan, "r2": math.nan}
        mse = sum(sums[f"sse_{j}"] for j in range(k)) / (n * k)
        r2s = []
        for j in range(k):
            ss_tot = sums[f"syy_{j}"] - sums[f"sy_{j}"] ** 2 / n
            r2s.append(1.0 - sums[f"sse_{j}"] / ss_tot if ss_tot > 0 else
                       (1.0 if sums[f"sse_{j}"] == 0 else 0.0))  # sklearn's constant-target rule
        return {"loss": mse, "mse": mse, "r2": sum(r2s) / k}


def bigram_loss(train_ids: torch.Tensor, test: Dataset[Any], vocab_size: int, *,
                alpha: float = 1.0, batch_size: int = 4096) -> float:
    """Mean next-token cross-entropy (nats) of a bigram model on ``test``'s ``(x, y)`` pairs:
    ``p(b | a) = (count(a, b) + alpha) / (count(a) + alpha V)`` from consecutive pairs of
    ``train_ids``."""
    v = int(vocab_size)
    flat = np.zeros(v * v, dtype=np.float64)
    step = 1 << 20  # pairs per chunk: a few MB of int64 temporaries, whatever the corpus size
    for a in range(0, max(len(train_ids) - 1, 0), step):
        w = train_ids[a : a + step + 1].long().numpy()
        flat += np.bincount(w[:-1] * v + w[1:], minlength=v * v)
    counts = flat.reshape(v, v)
    logp = torch.from_numpy(np.log(counts + alpha) - np.log(counts.sum(1, keepdims=True) + alpha * v))
    total, count = 0.0, 0
    n = len(test)  # type: ignore[arg-type]
    for a in range(0, n, batch_size):
        x, y = fetch_batch(test, torch.arange(a, min(a + batch_size, n)))[:2]
        total -= float(logp[x.reshape(-1), y.reshape(-1)].sum())
        count += y.numel()
    return total / max(count, 1)


class LanguageModelTask:
    """Next-token prediction over blocks of token ids (see the module docstring)."""

    name = "language_model"
    fitness_metric = "loss"
    fitness_mode: Literal["max", "min"] = "min"
    eval_batch_size = 128

    def __init__(self, task: TaskSpec, data: DataSpec) -> None:
        self.task, self.data = task, data

    def datasets(self, seed: int) -> tuple[Dataset[Any], Dataset[Any]]:
        if self.data.factory is not None:
            from ..models.zoo import import_object

            fn = import_object(self.data.factory, field="data.factory")
            try:
                out = fn(seed=seed, block_size=self.task.block_size, **self.data.kwargs)
            except TypeError as e:
                raise ConfigError([("data", f"factory {self.data.factory!r} rejected its "
                                            f"arguments: {e}")]) from None
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ConfigError([("data.factory", "a language-model data factory returns "
                                                    "(train, test) datasets")])
            return out[0], out[1]
        if self.data.name not in CORPORA:
            raise ConfigError([("data.name", f"language_model needs a text corpus; valid: "
                                             f"{', '.join(sorted(CORPORA))} (or a data.factory)")])
        from ..data.shakespeare import shakespeare

        try:
            return shakespeare(block_size=self.task.block_size, stride=self.task.stride,
                               **self.data.kwargs)
        except TypeError as e:
            raise ConfigError([("data", f"{self.data.name!r} rejected its arguments: {e}")]) from None

    @staticmethod
    def _vocab_size(train: Dataset[Any]) -> int:
        v = getattr(train, "vocab_size", None)
        if v is None:
            raise ConfigError([("data", "a language-model dataset needs a vocab_size attribute")])
        return int(v)

    def build_model(self, model_spec: ModelSpec, train: Dataset[Any]) -> nn.Module:
        if model_spec.factory is None and model_spec.name != "gpt":
            raise ConfigError([("model.name", f"language_model trains a sequence model over "
                                              f"token ids: use 'gpt' or a model.factory (got "
                                              f"{model_spec.name!r})")])
        x = train[0][0]
        return build_model(model_spec, input_shape=tuple(x.shape), num_classes=self._vocab_size(train))

    def loss(self, output: torch.Tensor, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), batch[1].reshape(-1))

    def eval_batch(self, output: torch.Tensor, batch: Sequence[torch.Tensor]) -> dict[str, float]:
        y = batch[1]
        nll = nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), y.reshape(-1),
                                          reduction="sum")
        return {"nll_sum": float(nll), "count": y.numel()}

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        loss = sums.get("nll_sum", 0.0) / max(sums.get("count", 0), 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
                "bits_per_token": loss / math.log(2)}

    def reference_metrics(self, train: Dataset[Any], test: Dataset[Any]) -> dict[str, float]:
        ids = getattr(train, "ids", None)
        if not isinstance(ids, torch.Tensor):
            return {}
        return {"bigram_test_loss": bigram_loss(ids, test, self._vocab_size(train))}


def _classification(job: JobConfig) -> ClassificationTask:
    return ClassificationTask(job.data)


def _regression(job: JobConfig) -> RegressionTask:
    return RegressionTask(job.data)


def _language_model(job: JobConfig) -> LanguageModelTask:
    return LanguageModelTask(job.task, job.data)


TASKS: dict[str, Any] = {
    "classification": _classification,
    "regression": _regression,
    "language_model": _language_model,
}
