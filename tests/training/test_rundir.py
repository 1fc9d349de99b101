"""training/rundir.py: metrics.jsonl after a crash. A run killed while appending leaves a
torn (partial) last line; reading drops it and a resume rewrites the file without it and
ends bit-identical to an uninterrupted run. A damaged line before the last is still a
ConfigError naming the file and the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_checkpoint import _doc, killed_run

import paratrain
from paratrain.config import ConfigError
from paratrain.training.rundir import MetricsWriter, read_metrics

pytestmark = pytest.mark.timeout(300)


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_torn_last_metrics_line_is_dropped_and_the_resume_is_bit_identical(tmp_path: Path) -> None:
    full = paratrain.fit(_doc(tmp_path, "full"))
    run = killed_run(tmp_path, "torn", "step-000000015")
    path = run / "metrics.jsonl"
    text = path.read_text()
    steps = _steps(run)
    # killed in the thread writing step 15's checkpoint; saves are asynchronous, so training
    # may have logged step 20 meanwhile
    assert steps in ([5, 10, 15], [5, 10, 15, 20]), steps
    last = text.splitlines()[-1]
    path.write_text(text[: len(text) - len(last) - 1] + last[: len(last) // 2])  # torn mid-record

    assert [r["step"] for r in read_metrics(run)] == steps[:-1]
    with pytest.warns(RuntimeWarning, match=rf"metrics.jsonl: dropping its torn last line {len(steps)}"):
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


def test_a_forked_child_does_not_keep_the_run_folder_locked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DataLoader worker outliving its SIGKILLed parent must not hold the folder's lock."""
    import fcntl
    import os
    import signal

    from paratrain.training import rundir

    monkeypatch.delenv(rundir.HELD_ENV, raising=False)
    rundir._acquire(tmp_path)
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child only sleeps
        os.write(ready_w, b"1")  # the fork hooks have run
        signal.pause()
    os.read(ready_r, 1)
    os.close(ready_r)
    os.close(ready_w)
    try:
        held, _count = rundir._HELD.pop(str(tmp_path.resolve()))
        os.close(held)  # as the parent's death does: no unlock
        fd = os.open(tmp_path / rundir.LOCK_NAME, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if the child held it
        finally:
            os.close(fd)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
