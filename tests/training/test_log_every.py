"""The training curve (``run.log_every``): a ``"kind": "train"`` record every N optimizer
steps in metrics.jsonl, drawn in report.png, the evaluation records unchanged, and a run
killed and resumed logs the curve the run that never stopped logs (no step twice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import paratrain
from paratrain.config import ConfigError
from paratrain.config.job import load_job
from paratrain.training import read_metrics
from paratrain.training.faults import FAULT_ENV
from paratrain.training.report import curves_figure

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)
CURVE_KEYS = {"kind", "step", "epoch", "train_loss", "lr", "steps_per_s", "samples_per_s",
              "step_time_s", "memory_mb"}


def _doc(tmp: Path, name: str, **run: Any) -> dict[str, Any]:
    return {
        "run": {"name": name, "seed": 3, "output_dir": str(tmp), "progress_every": "off", **run},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"epochs": 3, "batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.1}},
    }


def _curve(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir, train=True) if r.get("kind") == "train"]


def test_default_about_100_points_beside_unchanged_evaluation_records(tmp_path: Path) -> None:
    s = paratrain.fit(_doc(tmp_path, "a"))
    run = Path(s["run_dir"])
    curve = _curve(run)
    every = max(1, s["steps"] // 100)
    assert [r["step"] for r in curve] == list(range(every, s["steps"] + 1, every))
    assert len(curve) >= 100 and all(set(r) == CURVE_KEYS for r in curve)
    assert all(r["lr"] == 0.1 and r["steps_per_s"] > 0 and r["memory_mb"] > 0 for r in curve)
    assert curve[-1]["train_loss"] < curve[0]["train_loss"]
    # read_metrics gives the evaluation records as before: one per epoch
    assert [r["epoch"] for r in read_metrics(run)] == [1, 2, 3]
    # report.png's loss panel draws the curve, not the 3 evaluation-time means
    fig = curves_figure(run)
    try:
        line = next(x for x in fig.axes[0].get_lines() if x.get_label() == "train_loss")
        assert list(line.get_xdata()) == [r["step"] for r in curve]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_log_every_counts_steps_and_past_the_run_logs_none(tmp_path: Path) -> None:
    s = paratrain.fit(_doc(tmp_path, "ten", log_every=10))
    curve = _curve(Path(s["run_dir"]))
    assert [r["step"] for r in curve] == list(range(10, s["steps"] + 1, 10))
    s = paratrain.fit(_doc(tmp_path, "none", log_every=10_000))
    assert _curve(Path(s["run_dir"])) == []


def test_bad_settings_name_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for run, field, words in (({"log_every": -1}, "run.log_every", "greater than or equal"),
                              ({"loggers": ["tensorbored"]}, "run.loggers", "unknown logger 'tensorbored'"),
                              ({"loggers": ["wandb", "wandb"]}, "run.loggers", "listed twice")):
        with pytest.raises(ConfigError) as err:
            load_job(_doc(tmp_path, "bad", **run))
        assert field in str(err.value) and words in str(err.value), str(err.value)

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        load_job(_doc(tmp_path, "bad", loggers=["mlflow"]))
    assert "run.loggers" in str(err.value) and "pip install 'paratrain[mlflow]'" in str(err.value)


def test_killed_and_resumed_run_logs_the_same_curve_once(tmp_path: Path) -> None:
    whole = paratrain.fit(_doc(tmp_path, "whole", log_every=2))
    doc = _doc(tmp_path, "cut", log_every=2, checkpoint_every=25)
    job = tmp_path / "cut.json"
    job.write_text(json.dumps(doc))
    cmd = [sys.executable, "-m", "paratrain.cli", "run", "-q", str(job)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, FAULT_ENV: "0:61"}, timeout=240,
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert max(r["step"] for r in _curve(tmp_path / "cut")) == 60  # logged past the step-50 save
    paratrain.fit(doc, resume=True)
    # the window is checkpointed: the same losses at the same steps, none twice
    assert _curve(tmp_path / "cut") and [(r["step"], r["train_loss"]) for r in _curve(tmp_path / "cut")] == [
        (r["step"], r["train_loss"]) for r in _curve(Path(whole["run_dir"]))]
