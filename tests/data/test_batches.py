"""Issue 21 item 1: any batch, any model call. Dataset items may be tuples, dicts or any
pytree of tensors (collated by ``default_collate`` or the task's ``collate_fn``); a task
says how a batch feeds the model (default: a tuple's first field, a dict as ``model(**batch)``);
the built-in tasks read ``.logits`` and a model's own ``.loss``. Items that do not collate
are a ConfigError naming the field in ``validate`` and ``run`` (no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import paratrain
from paratrain.config import ConfigError
from paratrain.task import batch_rows, call_model, fetch_batch, model_args, to_device
from paratrain.task.builtin import ClassificationTask, LanguageModelTask, logits_of

HERE = Path(__file__).resolve().parents[1]


class Listed(Dataset[Any]):
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i]


def test_a_tensor_dataset_batch_is_the_tuple_of_its_rows() -> None:
    x, y = torch.randn(6, 3), torch.arange(6)
    batch = fetch_batch(TensorDataset(x, y), torch.tensor([4, 1]))
    assert type(batch) is tuple and torch.equal(batch[0], x[[4, 1]]) and torch.equal(batch[1], y[[4, 1]])


def test_dict_and_nested_items_collate_into_the_same_structure() -> None:
    items = [{"ids": torch.full((3,), i), "extra": (torch.tensor(float(i)), {"m": torch.ones(2)})}
             for i in range(4)]
    batch = fetch_batch(Listed(items), torch.tensor([2, 0]))
    assert set(batch) == {"ids", "extra"}
    assert batch["ids"].tolist() == [[2, 2, 2], [0, 0, 0]]
    assert batch["extra"][0].tolist() == [2.0, 0.0] and batch["extra"][1]["m"].shape == (2, 2)
    assert batch_rows(batch) == 2
    # tuple items: a tuple batch (default_collate gives a list)
    pairs = fetch_batch(Listed([(torch.zeros(2), torch.tensor(i)) for i in range(3)]), torch.arange(3))
    assert type(pairs) is tuple and pairs[1].tolist() == [0, 1, 2]


def test_a_collate_fn_is_used_and_devices_move_every_leaf() -> None:
    seen: list[int] = []

    def collate(items: list[Any]) -> Any:
        seen.append(len(items))
        return {"n": torch.tensor([len(it) for it in items]), "rows": [torch.zeros(1)]}

    batch = fetch_batch(Listed(["ab", "cde"]), torch.arange(2), collate=collate)
    assert seen == [2] and batch["n"].tolist() == [2, 3]
    moved = to_device(batch, torch.device("meta"))
    assert moved["n"].device.type == "meta" and moved["rows"][0].device.type == "meta"
    assert batch_rows(torch.tensor(3.0)) == 1


def test_how_a_batch_feeds_the_model() -> None:
    x, y = torch.ones(2, 3), torch.zeros(2)
    assert model_args(None, (x, y)) == ((x,), {})
    assert model_args(None, {"input_ids": x, "labels": y}) == ((), {"input_ids": x, "labels": y})
    assert model_args(None, x) == ((x,), {})
    hooks = [lambda b: b[1], lambda b: (b[0], b[1]), lambda b: {"a": b[0]}, lambda b: ((b[0],), {"k": b[1]})]
    want = [((y,), {}), ((x, y), {}), ((), {"a": x}), ((x,), {"k": y})]
    for hook, expected in zip(hooks, want, strict=True):
        assert model_args(SimpleNamespace(model_inputs=hook), (x, y)) == expected
    calls: list[Any] = []
    call_model(None, lambda *a, **k: calls.append((a, k)), {"input_ids": x})
    assert calls == [((), {"input_ids": x})]


def test_builtin_tasks_read_logits_and_a_models_own_loss() -> None:
    logits, y = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    want = torch.nn.functional.cross_entropy(logits, y)
    assert logits_of(SimpleNamespace(logits=logits)) is logits
    assert logits_of({"logits": logits}) is logits and logits_of((logits, None)) is logits
    task = ClassificationTask(SimpleNamespace())  # type: ignore[arg-type]
    for out in (logits, SimpleNamespace(logits=logits, loss=None), {"logits": logits}, (logits,)):
        assert torch.equal(task.loss(out, (None, y)), want)
    own = torch.tensor(7.0)
    # a model given labels (a dict batch) reports its own loss: the task uses it
    assert task.loss(SimpleNamespace(logits=logits, loss=own), {"x": None, "labels": y}) is own
    sums = task.eval_batch(SimpleNamespace(logits=logits, loss=own), {"labels": y})
    assert sums["loss_sum"] == 7.0 * 4 and sums["count"] == 4
    lm = LanguageModelTask(SimpleNamespace(), SimpleNamespace())  # type: ignore[arg-type]
    seq = torch.randn(2, 3, 5)
    ids = torch.randint(0, 5, (2, 3))
    assert torch.allclose(lm.loss(SimpleNamespace(logits=seq, loss=None), (ids, ids)),
                          torch.nn.functional.cross_entropy(seq.reshape(6, 5), ids.reshape(6)))
    with pytest.raises(ConfigError, match="'labels' field"):
        task.loss(logits, {"pixels": logits})


def _fit(tmp_path: Path, style: str, **extra: Any) -> dict[str, Any]:
    return paratrain.fit({"task": {"factory": "dict_task:make_task", "style": style},
                          "train": {"max_steps": 12, "batch_size": 32, "eval_every": 6},
                          "run": {"output_dir": str(tmp_path), "name": style}, **extra})


def test_dict_and_pytree_items_train_as_the_tuple_items_do(tmp_path: Path) -> None:
    """The same numbers as dicts fed by keyword (the model's own loss), or as a nested
    pytree through the task's collate_fn and model_inputs: bit-identical parameters."""
    ref = _fit(tmp_path, "tuple")
    for style in ("dict", "nested"):
        got = _fit(tmp_path, style)
        assert got["parameters_sha256"] == ref["parameters_sha256"], style
        assert got["test_accuracy"] == ref["test_accuracy"]


def test_items_that_do_not_collate_are_named_by_validate_and_run(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(textwrap.dedent(f"""
        [task]
        factory = "dict_task:make_task"
        style = "strings"
        [train]
        max_steps = 2
        [run]
        output_dir = "{tmp_path}"
    """))
    for command in ("validate", "run"):
        proc = subprocess.run([sys.executable, "-m", "paratrain.cli", command, str(job)],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(HERE)})
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        out = proc.stdout + proc.stderr
        assert "task.factory" in out and "do not make a batch" in out, out
        assert "Traceback" not in out
