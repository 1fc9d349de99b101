"""DataParallel through the real launcher: a SIGKILLed rank is restarted by the elastic
agent and the run ends with the parameters of an uninterrupted run; so does a whole-job
interruption followed by ``resume=True``; the example matches Local's accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.comm.launch import WorkerError
from paratrain.config import load_job
from paratrain.executors import data_parallel as dp
from paratrain.executors import local

pytestmark = pytest.mark.timeout(400)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data_parallel_digits.toml"


def _job(tmp: Path, name: str, max_restarts: int) -> object:
    return load_job({
        "run": {"name": name, "seed": 1, "output_dir": str(tmp), "max_restarts": max_restarts,
                "checkpoint_every": 4},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"epochs": 1, "batch_size": 16, "max_steps": 14, "eval_every": 5,
                  "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
        "strategy": {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}},
        # Error-feedback residuals are per-rank state that a restart must restore too.
        "compression": {"method": "ErrorFeedback", "error_compensation": True,
                        "base_strategy": {"method": "TopK", "k": 40}},
    })


def _steps(run_dir: str) -> list[int]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["step"] for x in lines if "test_accuracy" in json.loads(x)]


def test_sigkill_elastic_restart_and_whole_job_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = dp.run(_job(tmp_path, "clean", 0))  # type: ignore[arg-type]
    assert clean["steps"] == 14 and clean["restart_count"] == 0
    assert clean["compression"]["ratio"] < 0.5

    # Rank 1 SIGKILLs itself after step 6 (last complete checkpoint: step 4).
    monkeypatch.setenv(dp.FAULT_ENV, "1:6")
    restarted = dp.run(_job(tmp_path, "killed", 1))  # type: ignore[arg-type]
    assert restarted["restart_count"] == 1
    assert restarted["parameters_sha256"] == clean["parameters_sha256"]
    assert _steps(restarted["run_dir"]) == _steps(clean["run_dir"]) == [5, 10, 14]

    # No restarts allowed: the job fails with the signal as root cause...
    with pytest.raises(WorkerError, match="Signal 9|SIGKILL"):
        dp.run(_job(tmp_path, "resumed", 0))  # type: ignore[arg-type]
    # ...and `--resume` finishes it with the same parameters.
    monkeypatch.delenv(dp.FAULT_ENV)
    resumed = dp.run(_job(tmp_path, "resumed", 0), resume=True)  # type: ignore[arg-type]
    assert resumed["parameters_sha256"] == clean["parameters_sha256"]
    assert _steps(resumed["run_dir"]) == [5, 10, 14]


def test_example_matches_local_accuracy(tmp_path: Path) -> None:
    doc = load_job(EXAMPLE).to_json_dict()
    doc["run"].update(output_dir=str(tmp_path), max_restarts=0)
    doc["train"]["epochs"] = 10
    dp_summary = dp.run(load_job(doc))
    local_doc = json.loads(json.dumps(doc))
    local_doc["strategy"] = {"type": "Local"}
    local_doc["run"]["name"] = "local"
    local_doc["train"]["batch_size"] = doc["train"]["batch_size"] * 2  # same rows per step
    local_summary = local.run(load_job(local_doc))
    assert dp_summary["num_replicas"] == 2 and dp_summary["epochs"] == 10
    assert dp_summary["test_accuracy"] > 0.9
    assert abs(dp_summary["test_accuracy"] - local_summary["test_accuracy"]) <= 0.01
