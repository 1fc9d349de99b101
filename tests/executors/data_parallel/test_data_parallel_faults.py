"""DataParallel through the real launcher, on examples/data_parallel_digits.toml:

* it reaches Local's test accuracy (within 1 point) on digits with the same rows per step;
* a whole-job interruption (a rank SIGKILLed, no restarts allowed) followed by
  ``resume=True``, during which another rank is SIGKILLed and restarted by the elastic
  agent (every rank resumes from the last complete checkpoint), ends with the
  uninterrupted run's parameters (SHA-256 over every parameter) and metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from paratrain.comm.launch import WorkerError
from paratrain.config import load_job
from paratrain.config.job import JobConfig
from paratrain.executors import local
from paratrain.executors.data_parallel import runner as dp

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "data_parallel_digits.toml"
KILL_AT = 130  # rank 1 dies after step 130; the last complete checkpoint is step 120
KILL_AT_RESUMED = 250  # then rank 0 dies after step 250 (checkpoint 240) in the resumed run


def _example(tmp: Path, name: str, max_restarts: int) -> JobConfig:
    doc: dict[str, Any] = load_job(EXAMPLE).to_json_dict()
    doc["run"].update(name=name, output_dir=str(tmp), max_restarts=max_restarts, checkpoint_every=40)
    doc["train"].update(epochs=8, eval_every=100)
    return load_job(doc)


def _eval_steps(run_dir: str) -> list[int]:
    records = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "test_accuracy" in r]


def test_example_accuracy_sigkill_restart_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clean = dp.run(_example(tmp_path, "clean", 0))
    assert clean["num_replicas"] == 2 and clean["epochs"] == 8 and clean["restart_count"] == 0
    assert clean["steps"] == 8 * 43  # 1347 rows: 673 per replica, 43 batches of 16

    # Same rows per step in one process: the accuracy must match within one point.
    local_doc = _example(tmp_path, "local", 0).to_json_dict()
    local_doc["strategy"] = {"type": "Local"}
    local_doc["train"]["batch_size"] *= 2
    local_summary = local.run(load_job(local_doc))
    assert clean["test_accuracy"] > 0.9
    assert abs(clean["test_accuracy"] - local_summary["test_accuracy"]) <= 0.01

    # Whole-job interruption: rank 1 is SIGKILLed after step 130 and no restart is
    # allowed, so the job fails with the signal as its root cause...
    monkeypatch.setenv(dp.FAULT_ENV, f"1:{KILL_AT}")
    with pytest.raises(WorkerError, match="Signal 9|SIGKILL"):
        dp.run(_example(tmp_path, "interrupted", 0))
    # ...then `resume` continues from step 120; on the way rank 0 is SIGKILLed after step
    # 250, the elastic agent restarts the group, and every rank resumes from step 240.
    monkeypatch.setenv(dp.FAULT_ENV, f"0:{KILL_AT_RESUMED}")
    resumed = dp.run(_example(tmp_path, "interrupted", 1), resume=True)
    assert resumed["restart_count"] == 1  # the second kill really happened
    assert resumed["parameters_sha256"] == clean["parameters_sha256"]
    assert _eval_steps(resumed["run_dir"]) == _eval_steps(clean["run_dir"])
