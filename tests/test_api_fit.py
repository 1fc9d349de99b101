"""Issue 21 item 5: ``paratrain.fit`` trains on the data it is given -- ``(X, y)`` arrays,
a Dataset or a ``(train, test)`` pair -- or refuses naming ``data``; never the built-in
digits in their place. Model and data instances work under the multi-process strategies
too (pickled to the workers), training what the same job trains from factories."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import paratrain
from paratrain.config import ConfigError
from paratrain.data.datasets import split_arrays

pytestmark = [pytest.mark.timeout(300)]


def noise(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Pure-noise features and labels (a data factory: the reference for fit's arrays)."""
    del seed
    rng = np.random.default_rng(7)
    return rng.normal(size=(240, 12)).astype(np.float32), rng.integers(0, 3, 240)


def net(input_shape: tuple[int, ...] = (12,), num_classes: int = 3) -> nn.Module:
    """A seeded MLP (a model factory: the reference for fit's instance)."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(input_shape[0], 16), nn.ReLU(), nn.Linear(16, num_classes))


def _fit(tmp_path: Path, name: str, **kw: Any) -> dict[str, Any]:
    job = {"train": {"max_steps": 15, "batch_size": 16, "optimizer": {"name": "adam", "lr": 0.01}},
           "model": {"name": "mlp", "hidden": [16]}, **kw.pop("job", {})}
    return paratrain.fit(job, run={"output_dir": str(tmp_path), "name": name}, **kw)


def test_arrays_are_trained_on_as_a_data_factory_of_them(tmp_path: Path) -> None:
    x, y = noise()
    got = _fit(tmp_path, "arrays", data=(x, y))
    ref = _fit(tmp_path, "factory", data={"factory": "test_api_fit:noise"})
    assert got["parameters_sha256"] == ref["parameters_sha256"]
    assert got["test_accuracy"] == ref["test_accuracy"] < 0.6  # noise: not the digits' 0.9
    tensors = _fit(tmp_path, "tensors", data=(torch.from_numpy(x), torch.from_numpy(y)))
    assert tensors["parameters_sha256"] == ref["parameters_sha256"]


def test_a_dataset_or_a_train_test_pair_is_what_trains(tmp_path: Path) -> None:
    x, y = noise()
    bundle = split_arrays(x, y, test_fraction=0.25, seed=0)
    pair = _fit(tmp_path, "pair", data=(bundle.train, bundle.test))
    assert pair["parameters_sha256"] == _fit(tmp_path, "arrays", data=(x, y))["parameters_sha256"]
    whole = TensorDataset(torch.from_numpy(x), torch.from_numpy(y).long())
    one = _fit(tmp_path, "one", data=whole)
    assert one["test_accuracy"] < 0.6 and one["parameters_sha256"] != pair["parameters_sha256"]
    # the single Dataset's split is seeded: the same run twice trains the same
    assert _fit(tmp_path, "one", data=whole, overwrite=True)["parameters_sha256"] == one["parameters_sha256"]


class _Dicts(Dataset[Any]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return {"input_ids": torch.zeros(4, dtype=torch.long), "labels": torch.tensor(i % 2)}


class _Unpicklable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 3)
        self.hook = lambda x: x  # a lambda does not pickle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.hook(x))


def test_what_fit_cannot_train_is_refused_naming_the_field(tmp_path: Path) -> None:
    for data, words in ((42, "fit takes data"), (_Dicts(), "model's input shape"),
                        ((np.zeros((5, 3)), np.zeros(4)), "do not match")):
        with pytest.raises(ConfigError) as e:
            _fit(tmp_path, "bad", data=data)
        assert e.value.problems[0][0] == "data" and words in e.value.problems[0][1], e.value.problems
    with pytest.raises(ConfigError) as e:
        _fit(tmp_path, "bad", data=noise(), model=_Unpicklable(),
             strategy={"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}})
    assert e.value.problems[0][0] == "model" and "cannot be pickled" in e.value.problems[0][1]
    assert not (tmp_path / "bad").exists()


DP = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
FEDERATED = {"strategy": {"type": "Federated", "num_clients": 2, "rounds": 2,
                          "aggregation": {"method": "FedAvg"}, "client_selection": {"method": "All"}},
             "federated": {"local_epochs": 1, "batch_size": 16}, "data": {"partition": {"method": "iid"}}}
PBT = {"strategy": {"type": "PopulationBased", "population_size": 2, "generations": 2,
                    "exploit": {"method": "Truncation", "fraction": 0.5},
                    "explore": {"method": "Perturbation", "factor": 0.2}},
       "population": {"epochs_per_generation": 1, "metric": "accuracy", "mode": "max"},
       "search_space": {"lr": {"type": "log_uniform", "low": 0.001, "high": 0.01}}}


@pytest.mark.slow
def test_instances_under_data_parallel_train_as_factories_do(tmp_path: Path) -> None:
    got = _fit(tmp_path, "dp", data=noise(), model=net(), strategy=DP)
    ref = _fit(tmp_path, "dp_ref", strategy=DP,
               job={"data": {"factory": "test_api_fit:noise"}, "model": {"factory": "test_api_fit:net"}})
    assert got["parameters_sha256"] == ref["parameters_sha256"]
    assert got["test_accuracy"] == ref["test_accuracy"] < 0.6


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["Federated", "PopulationBased"])
def test_instances_train_under(kind: str, tmp_path: Path) -> None:
    doc = FEDERATED if kind == "Federated" else PBT
    got = _fit(tmp_path, kind, data=noise(), model=net(), job=doc)
    ref = _fit(tmp_path, kind + "_ref", job={**doc, "data": {**doc.get("data", {}), "factory": "test_api_fit:noise"},
                                             "model": {"factory": "test_api_fit:net"}})
    assert got["test_accuracy"] == ref["test_accuracy"] < 0.6


@pytest.mark.slow
def test_a_task_instance_under_data_parallel_trains_as_its_factory(tmp_path: Path) -> None:
    from user_task import make_task

    got = paratrain.fit({"train": {"max_steps": 8, "batch_size": 16}}, task=make_task(8), strategy=DP,
                        run={"output_dir": str(tmp_path), "name": "task"})
    ref = paratrain.fit({"train": {"max_steps": 8, "batch_size": 16},
                         "task": {"factory": "user_task:make_task", "hidden": 8}}, strategy=DP,
                        run={"output_dir": str(tmp_path), "name": "task_ref"})
    assert got["parameters_sha256"] == ref["parameters_sha256"] and got["test_mae"] == ref["test_mae"]


@pytest.mark.slow
def test_dict_item_datasets_and_a_model_under_data_parallel(tmp_path: Path) -> None:
    """fit's own (train, test) Datasets of dict items reach the DataParallel workers and
    train what the same numbers as tuple items train."""
    from dict_task import Items, Net
    from paratrain.config.job import DataSpec
    from paratrain.data import load_data

    b = load_data(DataSpec(), seed=0)
    sha = []
    for style in ("tuple", "dict"):
        torch.manual_seed(0)
        data = (Items(*b.train.tensors, style), Items(*b.test.tensors, style))
        sha.append(_fit(tmp_path, style, data=data, model=Net(64, 10), strategy=DP)["parameters_sha256"])
    assert sha[0] == sha[1]


TP = {"tensor_parallel": {"tensor_parallel_size": 2}}
MP = {"strategy": {"type": "ModelParallel", "communication": {"protocol": "Direct"},
                   "partitions": [{"node_ids": ["2"], "target": {"WorkerId": "worker-1"}}]},
      "workers": [{"id": "worker-0"}, {"id": "worker-1"}]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["TensorParallel", "ModelParallel"])
def test_instances_shard_and_place_as_factories_do(kind: str, tmp_path: Path) -> None:
    """A model instance (pickled to the ranks) under tensor parallelism (its Linear pair split)
    and ModelParallel (its head on a second worker) trains to the factory's parameters."""
    doc = TP if kind == "TensorParallel" else MP
    got = _fit(tmp_path, kind, data=noise(), model=net(), job=doc)
    ref = _fit(tmp_path, kind + "_ref", job={**doc, "data": {"factory": "test_api_fit:noise"},
                                             "model": {"factory": "test_api_fit:net"}})
    assert got["parameters_sha256"] == ref["parameters_sha256"]
    assert got["test_accuracy"] == ref["test_accuracy"] < 0.6
