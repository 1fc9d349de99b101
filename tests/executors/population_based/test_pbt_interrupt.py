"""PopulationBased keeps progress on Ctrl-C: SIGINT to the CLI's process group stops a
2-worker population at the end of the generation in progress, after its population
checkpoint (every rank agreeing), exit 130; ``--resume`` on one worker ends with the
uninterrupted 2-worker run's best member, bit for bit (the population checkpoint is process
0's engine state; members move between workers as files)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from _interrupting import start_cli, wait_until
from paratrain.config import load_job
from paratrain.dispatch import execute
from paratrain.executors.population_based.member import member_path
from paratrain.training import read_metrics
from paratrain.training.stores import latest_folder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

GENERATIONS = 16


def _doc(out: Path) -> dict[str, Any]:
    return {
        "run": {"name": "pbt", "seed": 3, "output_dir": str(out), "num_workers": 2},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
        "strategy": {"type": "PopulationBased", "population_size": 3, "generations": GENERATIONS,
                     "exploit": {"method": "Truncation", "fraction": 0.5},
                     "explore": {"method": "Perturbation", "factor": 0.3}},
        "population": {"steps_per_generation": 100},
        "search_space": {"lr": {"type": "log_uniform", "low": 0.01, "high": 0.3}},
    }


def test_sigint_finishes_the_generation_in_progress_and_resume_is_bit_identical(tmp_path: Path) -> None:
    doc = _doc(tmp_path / "int")
    job = tmp_path / "job.json"
    job.write_text(json.dumps(doc))
    run_dir = tmp_path / "int" / "pbt"
    proc = start_cli(job)
    # rank 0 trains members 0 and 2: once member 0 of generation 1 is saved, member 2 of
    # generation 1 is in training -- the signal lands inside generation 1
    wait_until(member_path(run_dir, 1, 0).exists, proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-3000:]
    found = latest_folder(run_dir / "checkpoints")
    assert found is not None
    done = int(found.name[5:])
    assert done == 2  # the generation in progress at the signal was finished and saved
    assert max(int(r["generation"]) for r in read_metrics(run_dir)) == 1
    assert not (run_dir / "summary.json").exists()

    one = json.loads(json.dumps(doc))
    one["run"]["num_workers"] = 1  # and on another number of workers (the same-world resume:
    resumed = execute(load_job(one), resume=True)  # test_kill_resume_matrix)
    ref = execute(load_job(_doc(tmp_path / "ref")))
    assert resumed["parameters_sha256"] == ref["parameters_sha256"]
    assert resumed["final_fitness"] == ref["final_fitness"]
