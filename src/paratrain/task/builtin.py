"""The built-in tasks (``[task] name = ...``): classification (cross-entropy, accuracy),
regression (mse; r2 as scikit-learn's ``r2_score``, from sums) and language_model
(next-token cross-entropy, perplexity, bits per token, a bigram reference); docs/
tasks-and-models.md tells more. The output is read through :func:`logits_of`, so a raw
Hugging Face model trains without a wrapper; when a dict batch holds ``"labels"`` and the
output a ``.loss``, that is the model's own loss (evaluated as a row-weighted mean).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from ..config import ConfigError
from ..config.job import DataSpec, JobConfig, ModelSpec, TaskSpec
from ..data.datasets import CORPORA, REGRESSION_DATASETS, DataBundle, load_data
from ..data.loader import head, is_stream
from ..models import build_model
from .steps import fetch_batch


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: a tensor, ``.logits``, a dict's ``"logits"``, a tuple's first."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]  # type: ignore[no-any-return]
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model's output ({type(output).__name__}) is not a tensor and has no "
                    "'logits' (a tensor, an output with .logits, a dict with 'logits' or a "
                    "tuple whose first element is the logits)")


def targets_of(batch: Any) -> torch.Tensor:
    """A batch's targets: ``batch["labels"]`` of a dict batch, else ``batch[1]``."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise ConfigError([("data", f"a dict batch needs a 'labels' field for the built-in "
                                        f"tasks (it has {', '.join(map(str, batch)) or 'no fields'}"
                                        "); or give a task.factory")])
        return batch["labels"]  # type: ignore[no-any-return]
    if isinstance(batch, tuple | list) and len(batch) >= 2:
        return batch[1]  # type: ignore[no-any-return]
    raise ConfigError([("data", f"a built-in task needs (inputs, targets) batches or dicts with "
                                f"'labels' (got a {type(batch).__name__} batch)")])


def own_loss(output: Any, batch: Any) -> torch.Tensor | None:
    """The model's own ``.loss`` when a dict batch holds ``"labels"`` (module docstring), else None."""
    if not (isinstance(batch, Mapping) and "labels" in batch):
        return None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


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
        train = self.bundle.train
        if not isinstance(train, TensorDataset):  # fit's own Dataset: its batches say the rest
            return train, self.bundle.test
        _, y = _tensors(train, "classification")
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

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        own = own_loss(output, batch)
        if own is not None:
            return own
        return nn.functional.cross_entropy(logits_of(output), targets_of(batch))

    def eval_batch(self, output: Any, batch: Any) -> dict[str, float]:
        y, logits = targets_of(batch), logits_of(output)
        own = own_loss(output, batch)
        loss_sum = (float(own) * len(y) if own is not None else
                    float(nn.functional.cross_entropy(logits, y, reduction="sum")))
        return {"loss_sum": loss_sum, "correct": int((logits.argmax(dim=1) == y).sum()), "count": len(y)}

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

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        own = own_loss(output, batch)
        if own is not None:
            return own
        out, y = self._pair(logits_of(output), targets_of(batch))
        return nn.functional.mse_loss(out, y)

    def eval_batch(self, output: Any, batch: Any) -> dict[str, float]:
        out, y = self._pair(logits_of(output), targets_of(batch))
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

    def _blocks(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``({block_size, stride}, the other [data] keys)``: ``block_size`` and ``stride``
        are the task's (``[task]``); written under ``[data]`` they are taken from there when
        ``[task]`` leaves them unset, and are an error naming the field when both set them."""
        extra = dict(self.data.kwargs)
        blocks: dict[str, Any] = {"block_size": self.task.block_size, "stride": self.task.stride}
        for key in ("block_size", "stride"):
            if key not in extra:
                continue
            value = extra.pop(key)
            if key in self.task.model_fields_set and value != blocks[key]:
                raise ConfigError([(f"data.{key}", f"{key} belongs in [task] (task.{key} = "
                                                   f"{blocks[key]!r} is set there too, data.{key} "
                                                   f"= {value!r}): keep the one in [task]")])
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError([(f"data.{key}", f"must be a positive integer (got {value!r}; "
                                                   f"it belongs in [task])")])
            blocks[key] = value
        return blocks, extra

    def datasets(self, seed: int) -> tuple[Dataset[Any], Dataset[Any]]:
        blocks, extra = self._blocks()
        if self.data.factory is not None:
            from ..models.zoo import call_factory, import_object

            fn = import_object(self.data.factory, field="data.factory")
            out = call_factory(fn, self.data.factory, field="data.factory",
                               offered={"seed": seed, **blocks}, kwargs=extra)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ConfigError([("data.factory", "a language-model data factory returns "
                                                    "(train, test) datasets")])
            return out[0], out[1]
        if self.data.name not in CORPORA:
            raise ConfigError([("data.name", f"language_model needs a text corpus; valid: "
                                             f"{', '.join(sorted(CORPORA))} (or a data.factory)")])
        if self.data.name == "tokens":  # a flat file of token ids, memory-mapped
            from ..data.tokens import token_datasets

            return token_datasets(seed=seed, **blocks, test_fraction=self.data.test_fraction,
                                  **extra)
        from ..data.shakespeare import shakespeare

        try:
            return shakespeare(**blocks, **extra)
        except TypeError as e:
            raise ConfigError([("data", f"{self.data.name!r} rejected its arguments: {e}")]) from None

    @staticmethod
    def _vocab_size(train: Dataset[Any]) -> int:
        v = getattr(train, "vocab_size", None)
        if v is None:
            raise ConfigError([("data", "a language-model dataset needs a vocab_size attribute")])
        return int(v)

    def build_model(self, model_spec: ModelSpec, train: Dataset[Any]) -> nn.Module:
        if model_spec.factory is None and model_spec.name not in ("gpt", "hf"):
            raise ConfigError([("model.name", f"language_model trains a sequence model over "
                                              f"token ids: use 'gpt', 'hf' or a model.factory (got "
                                              f"{model_spec.name!r})")])
        item = head(train, 1)[0] if is_stream(train) else train[0]
        x = item["input_ids"] if isinstance(item, Mapping) and "input_ids" in item else item[0]
        return build_model(model_spec, input_shape=tuple(x.shape), num_classes=self._vocab_size(train))

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        own = own_loss(output, batch)
        if own is not None:
            return own
        logits = logits_of(output)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets_of(batch).reshape(-1))

    def eval_batch(self, output: Any, batch: Any) -> dict[str, float]:
        y = targets_of(batch)
        own = own_loss(output, batch)
        if own is not None:  # the model's mean loss, weighted by rows (module docstring)
            return {"nll_sum": float(own) * len(y), "count": len(y)}
        logits = logits_of(output)
        nll = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
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


TASKS: dict[str, Callable[[JobConfig], Any]] = {  # task.name -> the task of a job
    "classification": lambda job: ClassificationTask(job.data),
    "regression": lambda job: RegressionTask(job.data),
    "language_model": lambda job: LanguageModelTask(job.task, job.data),
}
