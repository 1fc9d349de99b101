"""ModelParallel through the full job path (``execute`` -> ``comm.launch`` -> worker_main):
DataStore training equals Local training; a Pipeline job stopped and resumed with
``--resume`` ends where an uninterrupted run ends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from paratrain.config import ConfigError
from paratrain.config.job import JobConfig
from paratrain.executors import execute

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _job(tmp: Path, name: str, strategy: dict[str, Any], max_steps: int, **extra: Any) -> JobConfig:
    return JobConfig.model_validate({
        "run": {"name": name, "seed": 3, "output_dir": str(tmp), "checkpoint_every": 4},
        "model": {"name": "mlp", "hidden": [32, 16]},
        "train": {"epochs": 1, "batch_size": 24, "max_steps": max_steps, "eval_every": 4,
                  "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
        "strategy": strategy,
        **extra,
    })


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return execute(_job(tmp_path_factory.mktemp("local"), "local", {"type": "Local"}, 8))


def test_datastore_job_matches_local(tmp_path: Path, local: dict[str, Any]) -> None:
    strategy = {"type": "ModelParallel", "communication": {"protocol": "DataStore"},
                "partitions": [{"node_ids": ["fc0", "act0", "head"], "target": {"WorkerId": "worker-1"}}]}
    out = execute(_job(tmp_path, "ds", strategy, 8))
    assert out["protocol"] == "DataStore" and out["steps"] == 8 and out["workers"] == 2
    assert [(s["rank"], s["nodes"]) for s in out["stages"]] == [
        (0, ["flatten"]), (1, ["fc0", "act0"]), (0, ["fc1", "act1"]), (1, ["head"])]
    assert out["test_loss"] == pytest.approx(local["test_loss"], rel=1e-5)
    assert out["test_accuracy"] == local["test_accuracy"]
    run = Path(out["run_dir"])
    assert json.loads((run / "summary.json").read_text())["test_loss"] == out["test_loss"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [4, 8]
    assert (run / "checkpoints" / "rank0").is_dir() and (run / "checkpoints" / "rank1").is_dir()
    assert not list((run / "datastore").rglob("*.pt")), "every exchanged file was consumed"


def test_pipeline_job_resume_continues_exactly(tmp_path: Path, local: dict[str, Any]) -> None:
    strategy = {"type": "ModelParallel",
                "communication": {"protocol": "Pipeline", "micro_batch_size": 10, "schedule": "GPipe"},
                "partitions": [{"node_ids": ["fc1", "act1"], "target": {"Tag": "mid"}},
                               {"node_ids": ["head"], "target": {"WorkerId": "last"}}]}
    workers = [{"id": "first"}, {"id": "second", "tags": ["mid"]}, {"id": "last"}]
    first = execute(_job(tmp_path, "pp", strategy, 4, workers=workers))
    assert first["steps"] == 4
    resumed = execute(_job(tmp_path, "pp", strategy, 8, workers=workers), resume=True)
    assert resumed["steps"] == 8 and resumed["schedule"] == "GPipe"
    # Momentum buffers and positions restored: equals the uninterrupted Local run.
    assert resumed["test_loss"] == pytest.approx(local["test_loss"], rel=1e-5)
    run = Path(resumed["run_dir"])
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [4, 8]


def test_job_errors_before_launch(tmp_path: Path) -> None:
    bad = {"type": "ModelParallel", "communication": {"protocol": "Pipeline", "micro_batch_size": 4},
           "partitions": [{"node_ids": ["fc0"], "target": {"WorkerId": "worker-1"}}]}
    with pytest.raises(ConfigError, match="one contiguous run"):
        execute(_job(tmp_path, "bad", bad, 2))
    unknown = dict(bad, communication={"protocol": "Direct"},
                   partitions=[{"node_ids": ["fc7"], "target": {"Tag": "gpu"}}])
    with pytest.raises(ConfigError) as info:
        execute(_job(tmp_path, "bad", unknown, 2))
    assert {p for p, _ in info.value.problems} == {"strategy.partitions[0].node_ids",
                                                   "strategy.partitions[0].target.Tag"}
