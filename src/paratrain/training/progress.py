"""Rich progress bars; shown on a terminal, silent otherwise (logs stay clean)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["progress_bar", "console"]

console = Console(stderr=True)


def progress_bar(*, enabled: bool | None = None) -> Progress:
    """A Progress with description, bar, count, elapsed and remaining time."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )
