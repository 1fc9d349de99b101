"""Interrupts keep progress: SIGINT/SIGTERM end a run at the next step boundary, after a
checkpoint, and a time-based checkpoint cadence (``run.checkpoint_every = "10m"``).

Why not let ``KeyboardInterrupt`` fly: the default cadence is once per epoch (139 k steps
on a token file), so Ctrl-C after 80 of 120 steps used to leave nothing to resume. Here
the first SIGINT or SIGTERM only sets a flag (:class:`StopFlag`); the loop finishes the
step it is in, writes a checkpoint and raises :class:`Interrupted` (a KeyboardInterrupt:
the CLI exits 130 and ``--resume`` continues bit-identically). A second signal while that
checkpoint is written is the user insisting: it raises at once -- unless it comes within
:data:`ECHO_S` seconds of the first. Ctrl-C reaches every process of the terminal's group,
the launcher included, and torch's elastic agent then stops its workers with the same
signal: a worker sees one Ctrl-C twice, milliseconds apart, and must not take the echo for
insistence (it would stop mid-step, with no checkpoint).

Several processes must stop at the **same** step (their checkpoint is one collective
save), but a signal reaches them at different moments. :func:`agree` therefore takes the
maximum of each rank's flags over the group after every step (one 2-int all-reduce): a
rank that saw the signal makes every rank stop, and a time cadence that is due on one
rank's clock makes every rank save. One process (``group=None``) needs no message.
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

__all__ = ["Interrupted", "StopFlag", "stop_on_signals", "Cadence", "parse_every", "agree", "ECHO_S"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
ECHO_S = 2.0  # a repeat signal this soon after the first is the launcher forwarding it


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM after writing its checkpoint at ``step`` (a
    ``unit``: Federated counts rounds, PopulationBased generations)."""

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
    """Within the block, the first SIGINT/SIGTERM sets the returned flag; a second one
    raises KeyboardInterrupt at once. The previous handlers are restored on exit. Off the
    main thread (where Python cannot install handlers) the flag never sets."""
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
    """When to checkpoint: every ``steps`` steps, at each epoch's end (``steps == 0`` and
    no time), or every ``seconds`` of wall time (measured from the start or the last save)."""

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
    """``(stop, time_due)`` true on every rank of ``group`` when true on any (None: one
    process, the local values)."""
    if group is None:
        return stop, time_due
    lo_stop, lo_due = C.all_min_ints([-int(stop), -int(time_due)], group=group)
    return lo_stop < 0, lo_due < 0
