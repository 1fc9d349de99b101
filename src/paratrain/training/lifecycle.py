"""One run's lifecycle around its units (an optimizer step, a Federated round, a PBT
generation), for every strategy: resume (and cut ``metrics.jsonl`` back), progress,
SIGINT/SIGTERM finishing the unit with one checkpoint on every process, the
``run.checkpoint_every`` cadence, the final save and the tests' fault hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from types import TracebackType
from typing import Any

from .faults import maybe_kill
from .interrupt import Agreement, Cadence, Interrupted, StopFlag, stop_on_signals
from .progress import progress_bar
from .rundir import MetricsWriter


class Lifecycle:
    """One process's lifecycle (every process of ``group`` makes the same calls in the same order)."""

    def __init__(self, *, store: Any, unit: str, total: int, label: str, state: Callable[[int], dict[str, Any]],
                 checkpoint_every: int | str = 0, group: Any = None, rank: int = 0,
                 restart_count: int = 0, metrics: MetricsWriter | None = None,
                 progress_every: int | str | None = None, show: bool | None | str = "auto",
                 record_offset: int = 0) -> None:
        self.record_offset = record_offset  # metrics records of unit d carry d + offset
        self.store, self.unit, self.total, self.label = store, unit, total, label
        self.state, self.group, self.rank, self.restart_count = state, group, rank, restart_count
        self.metrics = metrics
        self.cadence = Cadence(checkpoint_every)
        self.agreement = Agreement(group)  # a collective only at agreed units, not after each
        self.last_saved: int | None = None
        self.flag = StopFlag()
        # progress on the process that logs metrics ("auto"), or as told (None: on a terminal
        # or as lines, False: none)
        enabled = (None if metrics is not None else False) if show == "auto" else show
        self.bar = progress_bar(enabled=bool(enabled) if enabled is not None else None, every=progress_every)
        self._task: Any = None
        self._stack = ExitStack()

    def load(self) -> tuple[Any, dict[str, Any]] | None:
        """The newest readable checkpoint (collective), or None."""
        found: tuple[Any, dict[str, Any]] | None = self.store.load()
        return found

    def begin(self, done: int, *, resume: bool, found: bool, metrics: MetricsWriter | None = None) -> None:
        """The run continues after ``done`` units: later units' metrics are cut (taken again)."""
        if metrics is not None:
            self.metrics = metrics
        if resume and self.metrics is not None:
            self.metrics.truncate_after(self.unit, done + self.record_offset)
        self.last_saved = done if found else None

    def __enter__(self) -> Lifecycle:
        self.flag = self._stack.enter_context(stop_on_signals())
        self.bar.start()
        self._stack.callback(self.bar.stop)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stack.close()

    def show(self, done: int, **fields: Any) -> None:
        """Progress: ``done`` units, with ``loss=`` / ``info=`` when known."""
        if self._task is None:
            self._task = self.bar.add_task(self.label, total=self.total, completed=done, info="",
                                           unit=self.unit)
        self.bar.update(self._task, completed=done, **fields)

    def end_unit(self, done: int, *, boundary: bool = True, last: bool = False) -> None:
        """After unit ``done`` (collective): save when the cadence says so (``boundary``: an
        epoch ended; ``last``: the run's last unit) or a signal stops the run (then raise)."""
        halt, due = self.agreement.check(done, self.flag.requested, self.cadence.time_due())
        if self.cadence.step_due(done, boundary) or due or last or (halt and self.last_saved != done):
            self.save(done)
        maybe_kill(rank=self.rank, step=done, restart_count=self.restart_count, before=self.wait)
        if halt:
            self.wait()
            raise Interrupted(self.flag.signame or "a signal to another worker", done, self.unit)

    def save(self, done: int) -> None:
        """Checkpoint after ``done`` units (collective; asynchronous: :meth:`wait` for it)."""
        start = getattr(self.store, "start_save", self.store.save)
        start(done, self.state(done))
        self.last_saved = done
        self.cadence.saved()

    def wait(self) -> None:
        """The last save is written."""
        wait = getattr(self.store, "wait", None)
        if wait is not None:
            wait()

    def finish(self, done: int) -> None:
        """The run ends after ``done`` units: saved (unless it was) and written; trackers closed."""
        if self.last_saved != done:
            self.save(done)
        self.wait()
        if self.metrics is not None:
            self.metrics.close()  # the trackers' runs are complete with the run


def engine_state(done: int, engine: dict[str, Any], model: dict[str, Any] | None = None) -> dict[str, Any]:
    """The store's state of a strategy whose state is its engine's (Federated, PopulationBased)."""
    return {"model": dict(model or {}), "engine": engine, "step": done, "epoch": 0, "batch": 0,
            "rng": None, "losses": [], "loader": None, "scheduler": None, "optimizer_type": None,
            "layout": {}}
