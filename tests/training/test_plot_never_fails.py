"""A failed report plot is a warning naming the cause, never a crash, never silent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.executors.population_based.report import plot_population
from paratrain.training.report import plot_curves


def test_plot_curves_failure_warns(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train_loss": 1.0}) + "\n")
    (tmp_path / "report.png").mkdir()  # savefig cannot write over a folder
    with pytest.warns(RuntimeWarning, match="could not draw the report plot"):
        assert plot_curves(tmp_path) is None


def test_plot_curves_success_writes_png(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train_loss": 1.0}) + "\n")
    out = plot_curves(tmp_path)
    assert out is not None and out.stat().st_size > 0


def test_plot_population_failure_warns(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match="plot_population"):
        assert plot_population(tmp_path / "missing.json", tmp_path / "r.png", space={}) is None
