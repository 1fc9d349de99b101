"""How many intra-op threads a training process gives torch: ``run.num_threads``, else a
positive ``OMP_NUM_THREADS``, else the cores this process may use shared among this host's
training processes (``LOCAL_WORLD_SIZE``). Sums depend on the thread count: a job that must
be bit-identical across machines sets ``run.num_threads``. (One thread, the old default,
made the GPT demo's step 1.52x plain PyTorch's on 2 idle cores, issue 34.)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def intra_op_threads(job: Any, local: int | None = None) -> int:
    """The thread count of the module docstring (``local``: this host's processes)."""
    n = getattr(job.run, "num_threads", None)
    if n:
        return int(n)
    raw = os.environ.get("OMP_NUM_THREADS", "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    if local is None:  # LOCAL_WORLD_SIZE when set (and valid), else 1
        raw = os.environ.get("LOCAL_WORLD_SIZE", "")
        local = int(raw) if raw.isdigit() and int(raw) > 0 else 1
    return max(1, available_cores() // local)


@contextlib.contextmanager
def use_threads(n: int) -> Iterator[None]:
    """torch uses ``n`` intra-op threads in the block (``paratrain.fit``: the caller's after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
