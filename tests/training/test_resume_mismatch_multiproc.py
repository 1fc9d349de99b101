"""Resuming a multi-process run with another model names the tensor that differs (exit 2,
one line) and leaves the run folder as it was: the checkpoints and job.json (the launcher
writes nothing before the workers' resume check has passed) -- under DataParallel,
ModelParallel, TensorParallel and PopulationBased (2 processes each)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from paratrain import cli

STRATEGIES: dict[str, dict[str, Any]] = {
    "dp": {"strategy": {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}},
    "mp": {"strategy": {"type": "ModelParallel", "communication": {"protocol": "Direct"},
                        "partitions": [{"node_ids": ["head"], "target": {"WorkerId": "worker-1"}}]}},
    "tp": {"tensor_parallel": {"tensor_parallel_size": 2}},
    "pbt": {"strategy": {"type": "PopulationBased", "population_size": 2, "generations": 2,
                         "exploit": {"method": "Truncation", "fraction": 0.5},
                         "explore": {"method": "Perturbation", "factor": 0.2}},
            "population": {"steps_per_generation": 2},
            "search_space": {"lr": {"type": "log_uniform", "low": 0.01, "high": 0.1}}},
}


def _job(tmp: Path, kind: str, hidden: int, optimizer: str = "sgd") -> Path:
    p = tmp / f"job_{kind}_{hidden}_{optimizer}.json"
    doc: dict[str, Any] = {
        "run": {"name": kind, "seed": 1, "output_dir": str(tmp / "runs"), "checkpoint_every": 2},
        "model": {"name": "mlp", "hidden": [hidden]},
        "train": {"epochs": 1, "batch_size": 32, "max_steps": 4 if hidden == 32 else 8,
                  "optimizer": {"name": optimizer, "lr": 0.05}},
        **STRATEGIES[kind],
    }
    if kind == "pbt":  # generations of population.steps_per_generation, on 2 processes
        doc["run"] = {"name": kind, "seed": 1, "output_dir": str(tmp / "runs"), "num_workers": 2}
        doc["train"] = {"batch_size": 32, "optimizer": {"name": optimizer, "lr": 0.05}}
    p.write_text(json.dumps(doc))
    return p


def _ckpts(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted((run / "checkpoints").rglob("*"))
            if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_resume_with_another_model_names_the_tensor_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    assert cli.main(["run", "-q", str(_job(tmp_path, kind, 32))]) == 0
    run = tmp_path / "runs" / kind
    before = _ckpts(run)
    job_json = (run / "job.json").read_bytes()
    assert before  # non-vacuity: there is something to resume from
    capsys.readouterr()
    assert cli.main(["run", "-q", "--resume", str(_job(tmp_path, kind, 16))]) == 2
    err = capsys.readouterr().err
    assert "model" in err and "fc0.weight" in err, err
    if kind == "dp":
        assert "(32, 64)" in err and "(16, 64)" in err, err
    assert len(err.strip().splitlines()) <= 2, err  # one clean line (+ where the log is)
    assert _ckpts(run) == before
    assert (run / "job.json").read_bytes() == job_json
