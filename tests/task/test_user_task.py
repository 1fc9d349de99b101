"""A user task written only against the public Task protocol (tests/user_task.py: its own
Dataset, model, L1 loss and metrics) trains under Local, DataParallel, Federated and
PopulationBased; each summary reports the task's metrics and beats the untrained model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from paratrain import Task
from paratrain.config import load_job
from paratrain.dispatch import execute
from paratrain.task import evaluate
from user_task import make_task

pytestmark = [pytest.mark.timeout(600)]

STRATEGIES: dict[str, dict[str, Any]] = {
    "Local": {"strategy": {"type": "Local"}},
    "DataParallel": {"strategy": {"type": "DataParallel", "num_replicas": 2,
                                  "aggregation": {"method": "AllReduce"}}},
    "Federated": {"strategy": {"type": "Federated", "num_clients": 4, "rounds": 4,
                               "aggregation": {"method": "FedAvg"},
                               "client_selection": {"method": "All"}},
                  "federated": {"local_epochs": 2, "batch_size": 16},
                  "train": {"optimizer": {"name": "adam", "lr": 0.03}},
                  "data": {"partition": {"method": "iid"}}},
    "PopulationBased": {"strategy": {"type": "PopulationBased", "population_size": 2,
                                     "generations": 2,
                                     "exploit": {"method": "Truncation", "fraction": 0.5},
                                     "explore": {"method": "Perturbation", "factor": 0.2}},
                        "population": {"epochs_per_generation": 2, "metric": "mae", "mode": "min"},
                        "train": {"batch_size": 16, "optimizer": {"name": "adam", "lr": 0.03}},
                        "search_space": {"lr": {"type": "log_uniform", "low": 0.01, "high": 0.1}}},
}


def test_the_user_task_satisfies_the_protocol() -> None:
    assert isinstance(make_task(), Task)


@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_user_task_trains_under(kind: str, tmp_path: Path) -> None:
    doc: dict[str, Any] = {
        "run": {"name": kind.lower(), "seed": 2, "output_dir": str(tmp_path)},
        "task": {"factory": "user_task:make_task", "hidden": 16},
        "train": {"epochs": 6, "batch_size": 16, "optimizer": {"name": "adam", "lr": 0.03}},
        **STRATEGIES[kind],
    }
    summary = execute(load_job(doc))
    task = make_task(16)
    train, test = task.datasets(2)
    torch.manual_seed(2)
    untrained = evaluate(task.build_model(None, train), task, test)["mae"]
    assert {"test_loss", "test_mae", "test_rmse"} <= set(summary), summary
    assert summary["test_loss"] == pytest.approx(summary["test_mae"])
    assert summary["test_mae"] < 0.6 * untrained, (summary["test_mae"], untrained)
