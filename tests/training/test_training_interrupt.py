"""Interrupts keep progress (paratrain.training.lifecycle): SIGINT/SIGTERM stop a run at a
step boundary after a checkpoint (exit 130), ``--resume`` continues to the parameters of
an uninterrupted run, bit for bit; ``run.checkpoint_every`` also takes a wall time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import paratrain
from paratrain.config import ConfigError, parse_every
from paratrain.config.job import load_job
from paratrain.files import step_folders
from paratrain.training.lifecycle import Cadence, agree, stop_on_signals

pytestmark = pytest.mark.timeout(300)

# No epoch-end or step-count checkpoint before the signal: what resumes was written by it.
_STEPS = 400


def _doc(out: Path, *, strategy: dict[str, Any] | None = None, every: int | str = 100_000) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "run": {"name": "r", "seed": 5, "output_dir": str(out), "checkpoint_every": every},
        "model": {"name": "mlp", "hidden": [128]},
        "train": {"epochs": 200, "batch_size": 16, "max_steps": _STEPS, "eval_every": 10,
                  "optimizer": {"name": "adam", "lr": 1e-3}},
    }
    if strategy is not None:
        doc["strategy"] = strategy
    return doc


def _cli(job: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "paratrain.cli", "run", str(job), "-q", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if metrics.exists():
            lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.endswith("}")]
            if any(r.get("step", 0) >= step for r in lines):
                return
        time.sleep(0.01)
    raise AssertionError(f"no step {step} in {metrics}")


def _digest(run_dir: Path) -> str:
    return str(json.loads((run_dir / "summary.json").read_text())["parameters_sha256"])


def _write(tmp: Path, name: str, doc: dict[str, Any]) -> Path:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


def test_sigterm_to_the_cli_checkpoints_and_resume_is_bit_identical(tmp_path: Path) -> None:
    """``kill CLI_PID`` (SIGTERM to the launcher only, not its process group): the launcher
    stops the workers, which finish the step, save the same step and exit; 130. (Ctrl-C to
    the whole process group, every strategy: tests/training/test_kill_resume_matrix.py.)"""
    strategy = {"type": "DataParallel", "num_replicas": 2, "aggregation": {"method": "AllReduce"}}
    job = _write(tmp_path, "job", _doc(tmp_path / "int", strategy=strategy))
    run_dir = tmp_path / "int" / "r"

    proc = _cli(job)
    _wait_for_step(run_dir, 20, proc)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "--resume" in err
    ckpts = step_folders(run_dir / "checkpoints")
    assert ckpts, "no checkpoint written on SIGTERM"
    steps = {int(p.name[5:]) for p in ckpts}
    assert len(steps) == 1 and 20 <= steps.pop() < _STEPS  # the signal's step, not the end
    assert not [p for p in run_dir.rglob(".step-*")], "temp folder left behind"

    resumed = paratrain.fit(_doc(tmp_path / "int", strategy=strategy), resume=True)
    reference = paratrain.fit(_doc(tmp_path / "ref", strategy=strategy))
    assert resumed["steps"] == _STEPS
    assert _digest(run_dir) == _digest(tmp_path / "ref" / "r") == reference["parameters_sha256"]


def test_time_cadence_saves_by_wall_time(tmp_path: Path) -> None:
    """A "0.05s" cadence writes checkpoints during a run that takes longer than that, though its
    step cadence (once per epoch of 200) would write none before the end."""
    doc = _doc(tmp_path, every="0.05s")
    doc["train"]["max_steps"] = 600
    summary = paratrain.fit(doc)
    assert summary["steps"] == 600
    kept = step_folders(tmp_path / "r" / "checkpoints")
    # prune keeps the newest two: a save before the end exists beside the final one
    assert len(kept) == 2 and int(kept[0].name[5:]) < 600


def test_checkpoint_every_forms() -> None:
    assert parse_every(0) == (0, None) and parse_every(7) == (7, None)
    assert parse_every("10m") == (0, 600.0) and parse_every("1.5h") == (0, 5400.0)
    assert parse_every("90s") == (0, 90.0)
    for bad in ("10", "m", "-1m", "0s", "10 minutes", "1d"):
        with pytest.raises(ValueError, match="duration"):
            parse_every(bad)
    for bad_doc in ("10x", True, -3, 1.5):
        with pytest.raises(ConfigError, match="run.checkpoint_every"):
            load_job({"run": {"checkpoint_every": bad_doc}})
    job = load_job({"run": {"checkpoint_every": "10m"}})
    assert load_job(job.to_json_dict()).run.checkpoint_every == "10m"  # round-trips as written


def test_cadence_and_agreement_in_one_process() -> None:
    steps = Cadence(5)
    assert [s for s in range(1, 16) if steps.step_due(s, False)] == [5, 10, 15]
    epochs = Cadence(0)
    assert epochs.step_due(3, True) and not epochs.step_due(3, False)
    timed = Cadence("1s")
    assert not timed.step_due(5, True) and not timed.time_due()
    assert agree(True, False, None) == (True, False)


def test_the_launchers_echo_of_one_interrupt_is_not_insistence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C reaches a worker twice: from the terminal (its process group) and, milliseconds
    later, from the elastic agent stopping its workers with the same signal. That echo must
    not stop the step before its checkpoint; a repeat after ECHO_S is the user insisting."""
    from paratrain.training import lifecycle as interrupt

    with stop_on_signals() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the echo
        assert flag.signame == "SIGINT"
    monkeypatch.setattr(interrupt, "ECHO_S", 0.0)
    with pytest.raises(KeyboardInterrupt), stop_on_signals() as flag:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.requested
        os.kill(os.getpid(), signal.SIGINT)  # later than the echo window: at once


def _agreeing_ranks(ctx: Any, stop_at: int, every_s: float) -> dict[str, Any]:
    """Rank 1 sees a signal after unit ``stop_at``; every rank runs units until the group
    agrees to stop, counting the all-reduces the agreement makes."""
    import torch
    import torch.distributed as dist

    from paratrain.training import lifecycle as interrupt

    calls = []
    real = interrupt.C.all_min_ints

    def counted(values: Any, *, group: Any = None) -> list[int]:
        calls.append(1)
        return real(values, group=group)

    interrupt.C.all_min_ints = counted  # type: ignore[assignment]
    try:
        agreement = interrupt.Agreement(dist.group.WORLD, every_s=every_s)
        for done in range(1, 5001):
            torch.mm(torch.ones(32, 32), torch.ones(32, 32))  # a unit of work
            stop, _ = agreement.check(done, ctx.rank == 1 and done >= stop_at, False)
            if stop:
                return {"stopped": done, "checks": len(calls)}
        return {"stopped": None, "checks": len(calls)}
    finally:
        interrupt.C.all_min_ints = real  # type: ignore[assignment]


def test_the_group_agrees_at_the_same_units_without_a_collective_per_unit() -> None:
    from paratrain.comm.testing import run_distributed

    fast = run_distributed(_agreeing_ranks, 2, 300, 0.25)
    assert fast[0]["stopped"] == fast[1]["stopped"] is not None  # the same unit on every rank
    assert fast[0]["stopped"] >= 300
    assert fast[0]["checks"] == fast[1]["checks"] < 0.1 * fast[0]["stopped"]  # not one a unit
    # non-vacuity: a zero time bound checks after every unit, and stops at once
    every = run_distributed(_agreeing_ranks, 2, 300, 0.0)
    assert every[0]["stopped"] == every[1]["stopped"] == 300 and every[0]["checks"] == 300
