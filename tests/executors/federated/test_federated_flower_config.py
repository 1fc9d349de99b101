"""``[federated] runtime`` and ``[federated.flower]`` without a federation (no flwr needed):
validate and graph say which path runs, ``paratrain run`` refuses a Flower job, a Flower-only
table under the local runtime and SecAgg+ with an aggregator that needs single updates are
ConfigErrors naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from paratrain.cli import main
from paratrain.config import ConfigError
from paratrain.config.job import load_job
from paratrain.explain import explain


def _doc(runtime: str = "flower", method: str = "FedAvg", **flower: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "run": {"name": "fl_cfg", "seed": 0},
        "model": {"name": "mlp", "hidden": [8]},
        "data": {"name": "digits"},
        "strategy": {"type": "Federated", "num_clients": 4, "rounds": 1, "aggregation": {"method": method},
                     "client_selection": {"method": "All"}},
        "federated": {"runtime": runtime},
    }
    if flower:
        doc["federated"]["flower"] = flower
    return doc


def _validate(tmp_path: Path, doc: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(doc))
    rc = main(["validate", str(path)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_validate_and_graph_say_which_path_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _validate(tmp_path, _doc("flower", round_timeout=30.0), capsys)
    assert rc == 0 and "runs on Flower's Deployment Runtime" in out
    rc, out = _validate(tmp_path, _doc("local"), capsys)
    assert rc == 0 and "runs on the local path" in out
    assert "Flower's Deployment Runtime" in explain(load_job(_doc("flower")), shapes=False)["runtime"]


def test_flower_table_under_the_local_runtime_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r'federated.*read only with runtime = "flower"'):
        load_job(_doc("local", round_timeout=30.0))


def test_paratrain_run_refuses_a_flower_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _doc("flower")
    doc["run"]["output_dir"] = str(tmp_path / "runs")
    path = tmp_path / "job.json"
    path.write_text(json.dumps(doc))
    assert main(["run", str(path)]) == 2
    assert "federated.runtime" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "fl_cfg" / "metrics.jsonl").exists()


@pytest.mark.parametrize("method", ["FedMedian", "Krum", "FedTrimmedAvg"])
def test_secure_aggregation_with_a_robust_aggregator_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str) -> None:
    doc = _doc("flower", method, min_nodes=2, secure_aggregation={})
    rc, out = _validate(tmp_path, doc, capsys)
    assert rc == 2 and "federated.flower.secure_aggregation" in out and method in out


def test_secure_aggregation_needs_two_nodes_and_valid_ranges(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _validate(tmp_path, _doc("flower", "FedAdam", secure_aggregation={}), capsys)
    assert rc == 2 and "federated.flower.min_nodes" in out
    rc, _ = _validate(tmp_path, _doc("flower", "FedAdam", min_nodes=2, secure_aggregation={}), capsys)
    assert rc == 0
    with pytest.raises(ConfigError, match="power of 2"):
        load_job(_doc("flower", secure_aggregation={"modulus_range": 3 * 2**22}))
    with pytest.raises(ConfigError, match="below num_shares"):
        load_job(_doc("flower", secure_aggregation={"num_shares": 3, "reconstruction_threshold": 3}))
