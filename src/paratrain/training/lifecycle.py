"""One run's lifecycle around its units (an optimizer step, a Federated round, a PBT
generation), for every strategy: resume (and cut ``metrics.jsonl`` back), progress, the
``run.checkpoint_every`` cadence (:class:`Cadence`: steps, epochs or wall time), the final
save and the tests' fault hooks.

The first SIGINT/SIGTERM only sets a flag (:class:`StopFlag`): the run finishes its unit,
checkpoints on every process and raises :class:`Interrupted` (exit 130; ``--resume``
continues). A second signal raises at once, unless within :data:`ECHO_S` of the first (the
launcher's elastic agent forwards the same Ctrl-C). Processes stop at the same unit: at the
units :class:`Agreement` picks (as many as fit in :data:`AGREE_S` seconds, at most twice the
last interval) one all-reduce takes every rank's flags (:func:`agree`).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import FrameType, TracebackType
from typing import Any

from ..comm import collectives as C
from ..config import parse_every
from .faults import maybe_kill
from .progress import progress_bar
from .rundir import MetricsWriter

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
ECHO_S = 2.0  # a repeat signal this soon after the first is the launcher forwarding it
AGREE_S = 0.25  # a group agrees on signals and time cadence at least this often (wall time)
MAX_INTERVAL = 1024  # and at least every this many units


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM after writing its checkpoint at ``step`` (of ``unit``)."""

    def __init__(self, signame: str, step: int, unit: str = "step") -> None:
        self.signame, self.step = signame, step
        super().__init__(f"{signame} received; checkpoint at {unit} {step} written")


class StopFlag:
    """Set by the first SIGINT/SIGTERM while :func:`stop_on_signals` is active."""

    def __init__(self) -> None:
        self.signame: str | None = None
        self.at = 0.0  # time.monotonic() of the first signal

    @property
    def requested(self) -> bool:
        return self.signame is not None


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """Within the block, the first SIGINT/SIGTERM sets the returned flag; a second one raises
    KeyboardInterrupt. Off the main thread (no handlers there) the flag never sets."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        del frame
        if flag.requested:
            if time.monotonic() - flag.at < ECHO_S:
                return  # the launcher's echo of the same interrupt
            raise KeyboardInterrupt(signal.Signals(signum).name)
        flag.signame, flag.at = signal.Signals(signum).name, time.monotonic()

    saved = {s: signal.getsignal(s) for s in _SIGNALS}
    for s in _SIGNALS:
        signal.signal(s, handler)
    try:
        yield flag
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


class Cadence:
    """When to checkpoint: every ``steps`` steps, at each epoch's end (``steps == 0``), or
    every ``seconds`` of wall time since the start or the last save."""

    def __init__(self, every: int | str) -> None:
        self.steps, self.seconds = parse_every(every)
        self._last = time.monotonic()

    def saved(self) -> None:
        self._last = time.monotonic()

    def time_due(self) -> bool:
        return self.seconds is not None and time.monotonic() - self._last >= self.seconds

    def step_due(self, step: int, end_of_epoch: bool) -> bool:
        if self.seconds is not None:
            return False
        return (self.steps > 0 and step % self.steps == 0) or (self.steps == 0 and end_of_epoch)


def agree(stop: bool, time_due: bool, group: Any) -> tuple[bool, bool]:
    """``(stop, time_due)`` true on every rank of ``group`` when true on any."""
    if group is None:
        return stop, time_due
    lo_stop, lo_due = C.all_min_ints([-int(stop), -int(time_due)], group=group)
    return lo_stop < 0, lo_due < 0


class Agreement:
    """When ``group`` agrees (module docstring): :meth:`check` after every unit returns
    ``(stop, time_due)``, the same on every rank; ``(False, False)`` between checks."""

    def __init__(self, group: Any, *, every_s: float = AGREE_S) -> None:
        self.group, self.every_s = group, every_s
        self.interval = 1
        self._next: int | None = None  # the unit after which the group checks next
        self._since = (0, time.monotonic())  # the last check's unit and time

    def check(self, done: int, stop: bool, time_due: bool) -> tuple[bool, bool]:
        if self.group is None:
            return stop, time_due
        if self._next is None:  # the first unit of this process's run
            self._next, self._since = done, (done - 1, self._since[1])
        if done < self._next:
            return False, False
        units, t0 = done - self._since[0], self._since[1]
        now = time.monotonic()
        per_unit = (now - t0) / max(units, 1)
        fits = int(self.every_s / per_unit) if per_unit > 0 else MAX_INTERVAL
        propose = max(1, min(2 * self.interval, fits, MAX_INTERVAL))
        lo_stop, lo_due, interval = C.all_min_ints([-int(stop), -int(time_due), propose], group=self.group)
        self.interval = interval
        self._next, self._since = done + interval, (done, now)
        return lo_stop < 0, lo_due < 0


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
