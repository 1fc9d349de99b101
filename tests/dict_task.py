"""A user task over the digits whose dataset items are not tuples, named in job files as
``task.factory = "dict_task:make_task"`` with ``style``:

- ``"tuple"``: ``(x, y)`` items, the model called as ``model(x)`` (the reference);
- ``"dict"``: ``{"pixels": x, "labels": y}`` items (a Hugging Face collator's shape), the
  model called as ``model(**batch)`` and returning an object with ``.logits`` and its own
  ``.loss`` (what a transformers model does when given labels);
- ``"nested"``: ``{"inputs": (x, {"scale": s}), "target": y}`` items collated by the task's
  ``collate_fn`` and fed by its ``model_inputs`` as ``model(x, scale=s)``;
- ``"strings"``: items that do not collate (a string field): a ConfigError naming the data.

Every style computes the same function of the same numbers in the same order, so the
trained parameters are bit-identical across styles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from paratrain.config.job import DataSpec
from paratrain.data import load_data


@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class Items(Dataset[Any]):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, style: str) -> None:
        self.x, self.y, self.style = x, y, style

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        x, y = self.x[i], self.y[i]
        if self.style == "dict":
            return {"pixels": x, "labels": y}
        if self.style == "nested":
            return {"inputs": (x, {"scale": torch.tensor(1.0)}), "target": y}
        if self.style == "strings":
            return {"pixels": x, "labels": y, "note": None}
        return x, y


class Net(nn.Module):
    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(features, 32)
        self.head = nn.Linear(32, classes)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None,
                scale: torch.Tensor | None = None) -> Any:
        logits = self.head(torch.relu(self.fc(pixels)))
        if scale is not None:
            logits = logits * scale[:, None]
        if labels is None:
            return logits
        return Output(logits, nn.functional.cross_entropy(logits, labels))


class DictTask:
    fitness_metric = "accuracy"
    fitness_mode: Literal["max", "min"] = "max"

    def __init__(self, style: str) -> None:
        self.style = style
        self.name = f"digits_{style}"
        if style == "nested":  # only this style has its own collate and model inputs
            self.collate_fn = self._collate
            self.model_inputs = self._model_inputs

    @staticmethod
    def _collate(items: list[Any]) -> Any:
        return default_collate(items)

    @staticmethod
    def _model_inputs(batch: Any) -> Any:
        x, extra = batch["inputs"]
        return (x,), {"scale": extra["scale"]}

    def datasets(self, seed: int) -> tuple[Dataset[Any], Dataset[Any]]:
        b = load_data(DataSpec(), seed=seed)
        return (Items(*b.train.tensors, self.style), Items(*b.test.tensors, self.style))

    def build_model(self, model_spec: Any, train: Dataset[Any]) -> nn.Module:
        del model_spec, train
        return Net(64, 10)

    def _pair(self, output: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = output.logits if isinstance(output, Output) else output
        y = batch["labels"] if self.style == "dict" else batch["target"] if self.style == "nested" else batch[1]
        return logits, y

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        if isinstance(output, Output) and output.loss is not None:
            return output.loss
        logits, y = self._pair(output, batch)
        return nn.functional.cross_entropy(logits, y)

    def eval_batch(self, output: Any, batch: Any) -> dict[str, float]:
        logits, y = self._pair(output, batch)
        return {"loss_sum": float(nn.functional.cross_entropy(logits, y, reduction="sum")),
                "correct": float((logits.argmax(1) == y).sum()), "count": float(len(y))}

    def finalize(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["count"], 1.0)
        return {"loss": sums["loss_sum"] / n, "accuracy": sums["correct"] / n}


def make_task(style: str = "tuple") -> DictTask:
    return DictTask(style)
