"""``parameters_sha256``: one meaning under every strategy (paratrain.training.summary.
parameters_digest): SHA-256 over each name and the bytes of its whole tensor, in the model's
state_dict order. A Local run and a ModelParallel run (2 stages) that end with equal
parameters report the same digest; each is the digest of the model the run saved."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from paratrain.config.job import JobConfig
from paratrain.dispatch import execute
from paratrain.training.export import load_model
from paratrain.training.summary import parameters_digest


def test_digest_of_a_model_is_its_state_dicts_names_and_bytes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    assert parameters_digest(model) == parameters_digest(model.state_dict()) == h.hexdigest()


def _job(tmp: Path, name: str, strategy: dict[str, Any]) -> JobConfig:
    # lr 1e-12: every update is below half an ulp of its weight, so both runs end with the
    # initial (seeded, equal) parameters bit for bit; at a real lr the two layouts differ in
    # the last bits (their matmuls accumulate in another order)
    return JobConfig.model_validate({
        "run": {"name": name, "seed": 3, "output_dir": str(tmp)},
        "model": {"name": "mlp", "hidden": [32, 16]},
        "train": {"epochs": 1, "batch_size": 24, "max_steps": 3,
                  "optimizer": {"name": "sgd", "lr": 1e-12, "momentum": 0.9}},
        "strategy": strategy,
    })


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_and_model_parallel_with_equal_parameters_report_the_same_digest(tmp_path: Path) -> None:
    local = execute(_job(tmp_path, "local", {"type": "Local"}))
    mp = execute(_job(tmp_path, "mp", {
        "type": "ModelParallel", "communication": {"protocol": "DataStore"},
        "partitions": [{"node_ids": ["fc0", "act0", "head"], "target": {"WorkerId": "worker-1"}}]}))
    assert mp["workers"] == 2 and len({s["rank"] for s in mp["stages"]}) == 2
    a, b = load_model(local["run_dir"]), load_model(mp["run_dir"])
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)  # equal parameters
    assert mp["parameters_sha256"] == local["parameters_sha256"]
    assert local["parameters_sha256"] == parameters_digest(a)  # the saved model's digest
