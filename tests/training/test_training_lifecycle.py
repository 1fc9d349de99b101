"""training/lifecycle.py: one lifecycle around every strategy's unit (a step, a round, a
generation): the checkpoint cadence, the last unit, a signal that stops at the next unit
boundary after a checkpoint, and metrics cut back on resume."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from paratrain.training.lifecycle import Interrupted, Lifecycle
from paratrain.training.rundir import MetricsWriter, read_metrics


class _Store:
    """Records what the lifecycle saves (the real stores are tested by the strategies)."""

    def __init__(self, found: tuple[Any, dict[str, Any]] | None = None) -> None:
        self.saved: list[int] = []
        self.found = found

    def save(self, step: int, state: dict[str, Any]) -> None:
        assert state == {"done": step}
        self.saved.append(step)

    def load(self) -> tuple[Any, dict[str, Any]] | None:
        return self.found


def _life(store: _Store, every: int | str, unit: str = "round", **kw: Any) -> Lifecycle:
    return Lifecycle(store=store, unit=unit, total=5, label="t", state=lambda d: {"done": d},
                     checkpoint_every=every, show=False, **kw)


@pytest.mark.parametrize(("every", "saved"), [(0, [1, 2, 3, 4, 5]), (2, [2, 4, 5]), ("1h", [5])])
def test_cadence_counts_units_and_the_last_is_always_saved(every: int | str, saved: list[int]) -> None:
    store = _Store()
    life = _life(store, every)
    life.begin(0, resume=False, found=False)
    with life:
        for done in range(1, 6):
            life.end_unit(done, last=done == 5)
    life.finish(5)  # already saved: not again
    assert store.saved == saved


def test_a_signal_stops_at_the_unit_boundary_after_a_checkpoint() -> None:
    store = _Store()
    before = signal.getsignal(signal.SIGINT)  # (pytest-xdist's workers ignore SIGINT)
    life = _life(store, "1h", unit="generation")
    life.begin(0, resume=False, found=False)
    with pytest.raises(Interrupted, match="SIGINT received; checkpoint at generation 2 written"), life:
        life.end_unit(1)
        os.kill(os.getpid(), signal.SIGINT)  # only sets the flag: the unit in progress ends
        life.end_unit(2)
    assert store.saved == [2]
    assert signal.getsignal(signal.SIGINT) is before  # the handler is restored


def test_resume_cuts_the_metrics_of_later_units(tmp_path: Path) -> None:
    metrics = MetricsWriter(tmp_path)
    for r in range(1, 5):
        metrics.log({"round": r, "loss": float(r)})
    (tmp_path / "pbt").mkdir()
    pbt = MetricsWriter(tmp_path / "pbt")
    for g in range(4):  # PopulationBased records count generations from 0
        pbt.log({"generation": g})
    store = _Store()
    _life(store, 0).begin(2, resume=True, found=True, metrics=metrics)
    _life(store, 0, unit="generation", record_offset=-1).begin(2, resume=True, found=True, metrics=pbt)
    assert [r["round"] for r in read_metrics(tmp_path)] == [1, 2]
    assert [r["generation"] for r in read_metrics(tmp_path / "pbt")] == [0, 1]
    life = _life(store, 0)
    life.begin(2, resume=True, found=True)
    life.finish(2)  # the checkpoint it resumed from: nothing to write
    assert store.saved == []
