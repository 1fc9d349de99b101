"""Progress without a terminal (issue 21, item 6): ``paratrain run`` with stderr a pipe (CI, a
notebook, a log file) writes a line every ``run.progress_every`` while it trains -- position,
train_loss, lr, the last evaluation (test_<metric>), steps/s, ETA -- on the logging process only; Federated counts rounds, PopulationBased
generations; ``"off"`` writes none."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paratrain.config import ConfigError, load_job
from paratrain.dispatch import execute
from paratrain.training.progress import LineProgress, parse_progress_every, progress_bar

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
LOCAL_LINE = re.compile(r"^\[Local\] step (\d+)/(\d+) \(\d+%\) train_loss [0-9.e+-]+ lr [0-9.e+-]+"
                        r"( test_accuracy [0-9.]+)? \| [0-9.e+]+ steps/s \| ETA \d+(s|m\d\ds)$")


def _job(tmp: Path, name: str, progress_every: Any, **sections: Any) -> Path:
    doc: dict[str, Any] = {
        "run": {"name": name, "seed": 0, "output_dir": str(tmp), "progress_every": progress_every},
        "model": {"name": "mlp", "hidden": [16]},
        "train": {"optimizer": {"name": "sgd", "lr": 0.05}},
    }
    for key, value in sections.items():
        doc[key] = {**doc.get(key, {}), **value}
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


def _cli(job: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "paratrain.cli", "run", str(job), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_run_without_a_terminal_logs_progress_lines_while_it_trains(tmp_path: Path) -> None:
    """About a second of training with ``progress_every = "0.25s"``: the first line is read
    from the pipe while the process still runs, and names a step before the last."""
    # ~1 s at ~2.5k steps/s of a tiny MLP (an unloaded core): 4 cadences, lines each 0.25 s
    total = 2_500
    proc = _cli(_job(tmp_path, "local", "0.25s",
                     train={"epochs": 10_000, "batch_size": 32, "max_steps": total, "eval_every": 1000}))
    assert proc.stderr is not None
    first = proc.stderr.readline()  # blocks until the first line; a run ending first gives ""
    running = proc.poll() is None
    rest, _ = proc.communicate(timeout=100)
    assert proc.returncode == 0, first + rest
    m = LOCAL_LINE.match(first.strip())
    assert m is not None, first + rest
    assert running and int(m.group(1)) < total and int(m.group(2)) == total, (first, rest)
    lines = [first.strip()] + [ln for ln in rest.splitlines() if ln.startswith("[Local]")]
    assert all(LOCAL_LINE.match(ln) for ln in lines), lines
    steps = [int(LOCAL_LINE.match(ln).group(1)) for ln in lines]  # type: ignore[union-attr]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)


def test_progress_off_prints_no_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """In this process (stderr captured: no terminal) a run of > 1 s with ``"off"`` writes no
    progress line; with a step cadence of 100 it writes one per 100 steps."""
    train = {"epochs": 10_000, "batch_size": 32, "max_steps": 400, "eval_every": 0}
    execute(load_job(json.loads(_job(tmp_path, "off", "off", train=train).read_text())))
    assert "[Local]" not in capfd.readouterr().err
    execute(load_job(json.loads(_job(tmp_path, "steps", 100, train=train).read_text())))
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("[Local]")]
    assert [ln.split()[2] for ln in lines] == ["100/400", "200/400", "300/400", "400/400"], lines


def test_federated_rounds_and_population_generations_log_on_rank_0_only(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Two worker processes each; one line per round / generation (``progress_every = 1``),
    not one per process. Launched from this process (whose stderr, captured, is no
    terminal): the workers write to the same stderr as under a CLI's pipe."""
    fed = _job(tmp_path, "fed", 1, run={"num_workers": 2},
               federated={"local_epochs": 1, "batch_size": 32},
               strategy={"type": "Federated", "num_clients": 4, "rounds": 3,
                         "aggregation": {"method": "FedAvg"}, "client_selection": {"method": "All"}})
    pbt = _job(tmp_path, "pbt", 1, run={"num_workers": 2},
               strategy={"type": "PopulationBased", "population_size": 2, "generations": 3,
                         "exploit": {"method": "Truncation", "fraction": 0.5},
                         "explore": {"method": "Perturbation", "factor": 0.3}},
               population={"steps_per_generation": 10},
               search_space={"lr": {"type": "log_uniform", "low": 0.01, "high": 0.3}})
    for job, label, unit in ((fed, "Federated", "round"), (pbt, "PopulationBased", "generation")):
        capfd.readouterr()
        execute(load_job(json.loads(job.read_text())))
        err = capfd.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith(f"[{label}]")]
        assert [ln.split()[1:3] for ln in lines] == [[unit, f"{g}/3"] for g in (1, 2, 3)], err
        assert all(f" {unit}s/s | ETA " in ln or f" s/{unit} | ETA " in ln for ln in lines), lines
        assert unit == "generation" or all(" train_loss " in ln for ln in lines), lines


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_line_progress_cadence_loss_rate_and_eta() -> None:
    """A line once ``seconds`` passed since the previous one (checked at each update): the
    mean loss since then, the rate since the start, ETA = (total - done) / rate."""
    import io

    out, clock = io.StringIO(), _Clock()
    bar = LineProgress(seconds=25.0, stream=out, clock=clock)
    task = bar.add_task("Local", total=1000, completed=100, info="")  # resumed at step 100
    for step in range(101, 1001):
        clock.t += 0.125  # 8 steps/s (exact in binary: the cadence is hit on the step)
        bar.update(task, completed=step, loss=1.0 if step <= 400 else 3.0, lr=0.003 if step < 600 else 0.001,
                   info="test_loss 2.17" if step >= 800 else None)
    bar.stop()
    assert out.getvalue().splitlines() == [  # no extra line at stop
        "[Local] step 300/1000 (30%) train_loss 1 lr 0.003 | 8 steps/s | ETA 1m28s",
        "[Local] step 500/1000 (50%) train_loss 2 lr 0.003 | 8 steps/s | ETA 1m02s",
        "[Local] step 700/1000 (70%) train_loss 3 lr 0.001 | 8 steps/s | ETA 38s",
        "[Local] step 900/1000 (90%) train_loss 3 lr 0.001 test_loss 2.17 | 8 steps/s | ETA 12s",
    ]


def test_the_setting_parses_and_names_the_field() -> None:
    assert parse_progress_every("off") is None and parse_progress_every(0) is None
    assert parse_progress_every("2m") == (0, 120.0) and parse_progress_every(50) == (50, None)
    assert isinstance(progress_bar(enabled=None, every="1s"), LineProgress)  # pytest: no terminal
    off = progress_bar(enabled=False, every="1s")  # lines with no cadence: it never writes
    assert isinstance(off, LineProgress) and off.steps == 0 and off.seconds is None
    with pytest.raises(ConfigError, match=r"run\.progress_every: .*'off'"):
        load_job({"run": {"progress_every": "soon"}})


def test_quiet_turns_progress_off_unless_the_job_sets_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``paratrain run -q``: no summary table and no progress lines (a job's own
    ``run.progress_every`` still holds)."""
    from paratrain import dispatch
    from paratrain.cli import main

    seen: list[Any] = []
    monkeypatch.setattr(dispatch, "execute", lambda job, **_: seen.append(job.run.progress_every) or {})
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"run": {"name": "q", "output_dir": str(tmp_path)}}))
    assert main(["run", str(plain), "-q"]) == 0 and main(["run", str(plain)]) == 0
    assert main(["run", str(_job(tmp_path, "set", "1s")), "-q"]) == 0
    assert seen == ["off", "30s", "1s"]
