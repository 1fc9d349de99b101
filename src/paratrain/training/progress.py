"""Progress of a run: a rich bar on a terminal, else a line every ``run.progress_every``::

    [Local] step 120/1000 (12%) train_loss 0.4321 lr 0.003 test_accuracy 0.912 | 8.31 steps/s | ETA 1m46s

(the mean loss since the previous line; the rate since this process started).
"""

from __future__ import annotations

import functools
import math
import sys
import time
from typing import TYPE_CHECKING, Any, NewType, TextIO

from ..config._base import parse_every

if TYPE_CHECKING:  # rich is imported for a bar on a terminal only (its import: ~40 ms of CPU)
    from rich.console import Console
    from rich.progress import Progress

TaskID = NewType("TaskID", int)  # rich.progress.TaskID's kind


@functools.cache
def _console() -> Console:
    from rich.console import Console

    return Console(stderr=True)


def parse_progress_every(every: int | str | None) -> tuple[int, float | None] | None:
    """``run.progress_every`` as ``(steps, seconds)``, None when off; default 30 s."""
    if every is None:
        return 0, 30.0
    if every == "off" or every == 0:
        return None
    return parse_every(every)


def _duration(seconds: float) -> str:
    """``1h02m``, ``3m05s``, ``12s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class LineProgress:
    """The calls of :class:`rich.progress.Progress` the loops use, as plain lines: one when
    ``steps`` more steps were done or ``seconds`` passed (neither: none). ``update(...,
    loss=x)`` adds to the next line's mean; ``unit`` (an ``add_task`` field) names the count."""

    def __init__(self, *, steps: int = 0, seconds: float | None = None, stream: TextIO | None = None,
                 clock: Any = time.monotonic) -> None:
        self.steps, self.seconds = steps, seconds
        self.stream, self.clock = stream, clock
        self.tasks: dict[TaskID, dict[str, Any]] = {}

    def start(self) -> None:
        pass

    def add_task(self, description: str, total: float | None = None, completed: float = 0,
                 **fields: Any) -> TaskID:
        now = self.clock()
        tid = TaskID(len(self.tasks))
        self.tasks[tid] = {"description": description, "total": total, "completed": completed,
                           "start": completed, "t0": now, "last_t": now, "last_done": completed,
                           "losses": [], "info": str(fields.get("info") or ""),
                           "unit": str(fields.get("unit") or "step")}
        return tid

    def update(self, task_id: TaskID, *, completed: float | None = None, loss: float | None = None,
               info: str | None = None, lr: float | None = None, **_: Any) -> None:
        if not self.steps and self.seconds is None:  # no cadence: nothing is shown, nothing kept
            return
        t = self.tasks[task_id]
        if lr is not None:
            t["lr"] = float(lr)
        if completed is not None:
            t["completed"] = completed
        if loss is not None and math.isfinite(loss):
            t["losses"].append(float(loss))
        if info:
            t["info"] = info
        now = self.clock()
        due_steps = self.steps > 0 and t["completed"] - t["last_done"] >= self.steps
        due_time = self.seconds is not None and now - t["last_t"] >= self.seconds
        if (due_steps or due_time) and t["completed"] != t["last_done"]:
            self._line(t, now)

    def stop(self) -> None:
        pass

    def _line(self, t: dict[str, Any], now: float) -> None:
        done, total = t["completed"], t["total"]
        parts = [f"[{t['description']}] {t['unit']} {int(done)}"]
        if total:
            parts[0] += f"/{int(total)} ({100.0 * done / total:.0f}%)"
        if t["losses"]:
            parts[0] += f" train_loss {sum(t['losses']) / len(t['losses']):.4g}"
        if t.get("lr") is not None:
            parts[0] += f" lr {t['lr']:.3g}"
        if t["info"]:
            parts[0] += f" {t['info']}"
        elapsed = now - t["t0"]
        rate = (done - t["start"]) / elapsed if elapsed > 0 else 0.0
        if rate > 0:
            unit = "steps" if t["unit"] == "step" else f"{t['unit']}s"
            parts.append(f"{rate:.0f} {unit}/s" if rate >= 100 else f"{rate:.3g} {unit}/s"
                         if rate >= 0.1 else f"{1.0 / rate:.3g} s/{t['unit']}")
            if total:
                parts.append(f"ETA {_duration(max(total - done, 0) / rate)}")
        print(" | ".join(parts), file=self.stream or sys.stderr, flush=True)
        t["last_t"], t["last_done"], t["losses"] = now, done, []


def progress_bar(*, enabled: bool | None = None,
                 every: int | str | None = None) -> Progress | LineProgress:
    """This process's progress: ``enabled=False`` none (another rank's; a
    :class:`LineProgress` that never writes), ``None`` a rich bar on a terminal else lines
    every ``every`` (``run.progress_every``; off: none), ``True`` the rich bar."""
    cadence = parse_progress_every(every)
    if enabled is None and cadence is not None and not sys.stderr.isatty():
        return LineProgress(steps=cadence[0], seconds=cadence[1])
    show = bool(sys.stderr.isatty() if enabled is None else enabled) and cadence is not None
    if not show:
        return LineProgress()
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=_console(),
        transient=False,
    )
