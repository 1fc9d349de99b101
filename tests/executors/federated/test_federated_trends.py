"""Paper trends on digits (MLP), through the real round loop in one process.

- McMahan et al. 2017: FedAvg (E=5, B=10) reaches a target accuracy in far fewer rounds
  than FedSGD (E=1, B=full) — here at most a third, with FedSGD given two learning
  rates; and the pathological 2-shards-per-client split needs more rounds than IID.
- Yin et al. 2018 / Blanchard et al. 2017: with 20% of clients sending -10x their
  update, FedAvg collapses while FedMedian, FedTrimmedAvg and Krum keep learning.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _workers_federated import fed_job
from paratrain.executors.federated import run_in_process
from paratrain.training.faults import inject_faults

TARGET = 0.95


@pytest.fixture(scope="module")
def fedavg_iid_rounds(tmp_path_factory: pytest.TempPathFactory) -> int:
    out = tmp_path_factory.mktemp("iid")
    s = run_in_process(fed_job(out, "fedavg", K=30, rounds=30, lr=0.3, local_epochs=5, batch_size=10,
                               sel={"method": "Random", "fraction": 0.2}, target_accuracy=TARGET))
    assert s["rounds_to_target"] is not None, "FedAvg (E=5, B=10) never reached the target"
    assert s["rounds"] == s["rounds_to_target"] + 1 or s["rounds"] == s["rounds_to_target"]
    return int(s["rounds_to_target"])


@pytest.mark.parametrize("lr", [0.5, 1.0])
def test_fedavg_needs_at_most_a_third_of_fedsgd_rounds(fedavg_iid_rounds: int, lr: float, tmp_path: Path) -> None:
    budget = 3 * fedavg_iid_rounds
    s = run_in_process(fed_job(tmp_path, "fedsgd", K=30, rounds=budget, lr=lr, local_epochs=1,
                               batch_size=None, sel={"method": "Random", "fraction": 0.2},
                               target_accuracy=TARGET))
    assert s["rounds"] == budget
    assert s["rounds_to_target"] is None, (fedavg_iid_rounds, s["rounds_to_target"])
    assert s["best_test_accuracy"] > 0.5  # FedSGD does learn, just more slowly


def test_two_shards_per_client_needs_more_rounds_than_iid(fedavg_iid_rounds: int, tmp_path: Path) -> None:
    cap = 2 * fedavg_iid_rounds
    s = run_in_process(fed_job(tmp_path, "shards", K=30, rounds=cap, lr=0.3, local_epochs=5, batch_size=10,
                               sel={"method": "Random", "fraction": 0.2}, target_accuracy=TARGET,
                               partition={"method": "shards", "shards_per_client": 2}))
    rtt = s["rounds_to_target"]
    assert rtt is None or rtt > fedavg_iid_rounds, (fedavg_iid_rounds, rtt)


BYZ = dict(K=10, rounds=12, lr=0.3, local_epochs=2, batch_size=10, sel={"method": "All"})
ATTACK = dict(byzantine_clients=[3, 7], byzantine_scale=-10.0)


@pytest.mark.parametrize(
    ("agg", "robust"),
    [
        ({"method": "FedAvg"}, False),
        ({"method": "FedMedian"}, True),
        ({"method": "FedTrimmedAvg", "beta": 0.2}, True),
        ({"method": "Krum", "num_malicious": 2}, True),
    ],
)
def test_byzantine_clients_break_fedavg_not_robust_aggregators(agg: dict, robust: bool, tmp_path: Path) -> None:
    with inject_faults(**ATTACK):
        s = run_in_process(fed_job(tmp_path, agg["method"], agg=agg, **BYZ))
    if robust:
        assert s["test_accuracy"] > 0.90, s["test_accuracy"]
    else:
        assert s["test_accuracy"] < 0.50, s["test_accuracy"]


def test_fedavg_without_attackers_learns(tmp_path: Path) -> None:
    """Non-vacuity for the test above: FedAvg fails because of the attack, not the setup."""
    kw = {**BYZ, "rounds": 6}
    s = run_in_process(fed_job(tmp_path, "clean", **kw))
    assert s["test_accuracy"] > 0.90, s["test_accuracy"]
