"""Local training on real digits: accuracy, outputs, bit-identical resume after a kill,
the fit() API, Custom coordinators and dispatch errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import paratrain
from paratrain.config import ConfigError
from paratrain.config.job import load_job
from paratrain.dispatch import execute
from paratrain.executors import register_coordinator, registered_coordinators
from paratrain.training import read_metrics
from paratrain.training.stores import LocalStore, latest_folder, read_rank_state

ROOT = Path(__file__).resolve().parents[2]


def _job(tmp_path: Path, name: str, **train: object) -> dict:
    return {
        "run": {"name": name, "seed": 3, "output_dir": str(tmp_path)},
        "model": {"name": "mlp", "hidden": [32]},
        "train": {"epochs": 3, "batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
                  **train},
    }


def test_local_trains_digits_and_writes_run_folder(tmp_path: Path) -> None:
    summary = paratrain.fit(_job(tmp_path, "a"))
    run_dir = tmp_path / "a"
    assert summary["test_accuracy"] > 0.90
    for f in ("job.json", "metrics.jsonl", "summary.json", "report.png"):
        assert (run_dir / f).is_file(), f
    assert json.loads((run_dir / "summary.json").read_text())["test_accuracy"] == summary["test_accuracy"]
    assert json.loads((run_dir / "job.json").read_text())["strategy"] == {"type": "Local"}
    assert [r["epoch"] for r in read_metrics(run_dir)] == [1, 2, 3]  # the evaluation records
    assert latest_folder(run_dir / "checkpoints") is not None


def test_same_seed_same_parameters_other_seed_differs(tmp_path: Path) -> None:
    a = paratrain.fit(_job(tmp_path, "s1", epochs=1))
    b = paratrain.fit(_job(tmp_path, "s2", epochs=1))
    assert a["parameters_sha256"] == b["parameters_sha256"]
    doc = _job(tmp_path, "s3", epochs=1)
    doc["run"]["seed"] = 4
    assert paratrain.fit(doc)["parameters_sha256"] != a["parameters_sha256"]


def test_checkpoints_load_with_weights_only(tmp_path: Path) -> None:
    """A checkpoint is a torch.distributed.checkpoint folder; its non-tensor parts are read
    with ``torch.load(weights_only=True)`` (DCP's own load would unpickle them)."""
    paratrain.fit(_job(tmp_path, "w", epochs=1))
    path = latest_folder(tmp_path / "w" / "checkpoints")
    assert path is not None
    assert read_rank_state(path)["step"] > 0


def test_resume_after_kill_is_bit_identical(tmp_path: Path) -> None:
    doc = _job(tmp_path, "full", epochs=4)
    doc["run"]["checkpoint_every"] = 5
    full = paratrain.fit(doc)

    doc["run"]["name"] = "killed"
    job_path = tmp_path / "killed.json"
    job_path.write_text(json.dumps(doc))
    cmd = [sys.executable, "-m", "paratrain.cli", "run", "-q", str(job_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    ckpts = tmp_path / "killed" / "checkpoints"
    deadline = time.monotonic() + 120
    while latest_folder(ckpts) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "summary.json").exists(), "run finished before it was killed"
    killed_at = read_rank_state(latest_folder(ckpts))["step"]
    assert 0 < killed_at < full["steps"]

    paratrain.fit(doc, resume=True)  # `paratrain run --resume`, in this process
    resumed = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert resumed["steps"] == full["steps"]
    assert resumed["parameters_sha256"] == full["parameters_sha256"]
    # metrics read as if the run had never stopped
    records = read_metrics(tmp_path / "killed", train=True)
    for kind in ("train", None):  # the training curve's records and the evaluation records
        steps = [r["step"] for r in records if r.get("kind") == kind]
        assert steps and steps == sorted(set(steps)), kind


def test_non_vacuity_different_resume_point_state_matters(tmp_path: Path) -> None:
    """Resuming with a fresh optimizer (dropping momentum) must NOT match: the parity
    test above would be vacuous if checkpoint contents did not matter."""
    doc = _job(tmp_path, "nv_full", epochs=2)
    full = paratrain.fit(doc)
    doc2 = _job(tmp_path, "nv_cut", epochs=2, max_steps=30)
    paratrain.fit(doc2)
    ckpts = tmp_path / "nv_cut" / "checkpoints"
    path = latest_folder(ckpts)
    assert path is not None
    state = read_rank_state(path)
    state["optimizer"]["state"] = {}
    state.pop("shards")
    LocalStore(ckpts).save(int(state["step"]), state)
    doc3 = _job(tmp_path, "nv_cut", epochs=2)
    assert paratrain.fit(doc3, resume=True)["parameters_sha256"] != full["parameters_sha256"]


def test_fit_accepts_instances(tmp_path: Path) -> None:
    from paratrain.config.job import DataSpec
    from paratrain.data import load_data

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    data = load_data(DataSpec(), seed=0)
    s = paratrain.fit(_job(tmp_path, "inst", epochs=2), model=model, data=data)
    assert s["num_parameters"] == 650 and s["test_accuracy"] > 0.85


def test_cnn_and_transformer_build_and_train_a_step(tmp_path: Path) -> None:
    for name in ("cnn", "transformer"):
        doc = _job(tmp_path, name, epochs=1, max_steps=3)
        doc["model"] = {"name": name}
        assert paratrain.fit(doc)["steps"] == 3


@register_coordinator("test-double-local")
def _double(job, config):  # type: ignore[no-untyped-def]
    return {"strategy": "Custom", "received": config, "name": job.run.name}


def test_custom_coordinator_receives_config(tmp_path: Path) -> None:
    job = load_job({"run": {"name": "c", "output_dir": str(tmp_path)},
                    "strategy": {"type": "Custom", "coordinator": "test-double-local",
                                 "config": {"k": [1, 2]}}})
    assert execute(job) == {"strategy": "Custom", "received": {"k": [1, 2]}, "name": "c"}


def test_unregistered_coordinator_lists_registered(tmp_path: Path) -> None:
    job = load_job({"strategy": {"type": "Custom", "coordinator": "nobody", "config": None}})
    with pytest.raises(ConfigError) as info:
        execute(job)
    msg = str(info.value)
    assert "nobody" in msg and "test-double-local" in msg
    assert "test-double-local" in registered_coordinators()


def test_cli_run_bad_coordinator_exit_2(tmp_path: Path) -> None:
    job = tmp_path / "c.toml"
    job.write_text('[strategy]\ntype = "Custom"\ncoordinator = "ghost"\nconfig = {}\n')
    r = subprocess.run([sys.executable, "-m", "paratrain.cli", "run", str(job)], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "strategy.coordinator" in r.stderr and "ghost" in r.stderr
    assert "Traceback" not in r.stderr


def test_custom_ensemble_example(tmp_path: Path) -> None:
    doc = load_job(ROOT / "examples" / "custom_ensemble.toml").model_dump(mode="json")
    doc["run"]["output_dir"] = str(tmp_path)
    doc["train"]["epochs"] = 2
    doc["run"]["imports"] = [str(ROOT / "examples" / "custom_ensemble.py")]
    summary = execute(load_job(doc))
    assert summary["members"] == 3
    assert summary["test_accuracy"] >= min(summary["member_accuracies"]) - 0.02
