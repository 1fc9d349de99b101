"""training/rundir.py: metrics.jsonl after a crash. A run killed while appending leaves a
torn (partial) last line; reading drops it and a resume rewrites the file without it and
ends bit-identical to an uninterrupted run. A damaged line before the last is still a
ConfigError naming the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import paratrain
from paratrain.config import ConfigError
from paratrain.training.rundir import MetricsWriter, read_metrics
from test_checkpoint import _doc, killed_run

pytestmark = pytest.mark.timeout(300)


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_torn_last_metrics_line_is_dropped_and_the_resume_is_bit_identical(tmp_path: Path) -> None:
    full = paratrain.fit(_doc(tmp_path, "full"))
    run = killed_run(tmp_path, "torn", "step-000000015")
    path = run / "metrics.jsonl"
    text = path.read_text()
    assert _steps(run) == [5, 10, 15]
    last = text.splitlines()[-1]
    path.write_text(text[: len(text) - len(last) - 1] + last[: len(last) // 2])  # torn mid-record

    assert [r["step"] for r in read_metrics(run)] == [5, 10]
    with pytest.warns(RuntimeWarning, match=r"metrics.jsonl: dropping its torn last line 3"):
        resumed = paratrain.fit(_doc(tmp_path, "torn"), resume=True)

    assert resumed["steps"] == 20 and resumed["parameters_sha256"] == full["parameters_sha256"]
    assert _steps(run) == [5, 10, 15, 20]  # rewritten: every line whole, as if never stopped
    assert path.read_text().endswith("\n")
    again = paratrain.fit(_doc(tmp_path, "torn"), resume=True)  # and later resumes still work
    assert again["parameters_sha256"] == full["parameters_sha256"]


def test_a_damaged_line_before_the_last_names_the_file_and_line(tmp_path: Path) -> None:
    run = killed_run(tmp_path, "bad", "step-000000015")
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = lines[1][:20]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        read_metrics(run)
    assert str(path) in str(err.value) and "line 2" in str(err.value)
    with pytest.raises(ConfigError) as err:
        paratrain.fit(_doc(tmp_path, "bad"), resume=True)
    assert str(path) in dict(err.value.problems)["metrics"] and "line 2" in str(err.value)


def test_truncate_after_keeps_the_records_up_to_the_resume_point(tmp_path: Path) -> None:
    w = MetricsWriter(tmp_path)
    for s in (1, 2, 3):
        w.log({"step": s, "loss": float("nan") if s == 2 else 0.5})
    w.truncate_after("step", 2)
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": None}]
