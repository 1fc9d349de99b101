"""Helpers for the PopulationBased tests that run inside spawned worker processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from paratrain.models.zoo import mlp

__all__ = ["crashing_mlp"]


def crashing_mlp(
    input_shape: tuple[int, ...], num_classes: int, *, hidden: list[int] | None = None,
    crash_when: str = "", crash_marker: str = "", **kw: Any,
) -> nn.Sequential:
    """The zoo MLP, except that the first build after ``crash_when`` exists kills the
    whole process (a hard crash, no exception), once: ``crash_marker`` records it."""
    if crash_when and os.path.exists(crash_when) and not os.path.exists(crash_marker):
        Path(crash_marker).write_text(f"crashed pid {os.getpid()}\n")
        os._exit(3)
    return mlp(input_shape, num_classes, hidden=hidden, **kw)
