"""Interrupts keep progress, and the time-based checkpoint cadence.

The first SIGINT/SIGTERM only sets a flag (:class:`StopFlag`): the loop finishes its step,
checkpoints and raises :class:`Interrupted` (exit 130; ``--resume`` continues). A second
signal raises at once, unless within :data:`ECHO_S` of the first (the launcher's elastic
agent forwards the same Ctrl-C). Processes stop at the same step: at the steps
:class:`Agreement` picks (as many as fit in :data:`AGREE_S` seconds, at most twice the last
interval) one all-reduce takes every rank's flags (:func:`agree`).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from ..comm import collectives as C
from ..config import parse_every

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
