"""How many intra-op threads a training process gives torch (``torch.set_num_threads``).

Default: **the cores this process may run on, shared among this host's training
processes** -- ``len(os.sched_getaffinity(0)) // local_processes``, at least one. One
process per host (a Local run, one worker per machine) gets every core, as torch's own
default does; ``n`` workers on one host get ``cores // n`` each, so together they fill the
cores without oversubscribing them (torchrun's convention of ``OMP_NUM_THREADS=1`` for
several processes per host is the special case of as many processes as cores). The local
process count is ``LOCAL_WORLD_SIZE`` (set by torch's elastic agent and torchrun).

``run.num_threads`` wins, then a positive ``OMP_NUM_THREADS`` (the variable torch and
torchrun read). A run's floating-point sums depend on the thread count, so a default taken
from the machine can give other parameters on another machine (the differences are
rounding-sized); a job that must be bit-identical across machines sets ``run.num_threads``
(an opt-in: the same count everywhere, the same sums).

Why not one thread (this project's earlier default): it was chosen on a shared 2-core CI
box, where a descheduled OpenMP thread holds up every kernel. On a user's idle laptop or
workstation it left the other cores unused: the GPT demo's step took 1.52x a plain PyTorch
loop at torch's defaults on 2 idle cores (issue 34), more with more cores.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["available_cores", "intra_op_threads", "use_threads"]


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where the
    platform has no affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def local_processes() -> int:
    """This host's training processes: ``LOCAL_WORLD_SIZE`` when set (and valid), else 1."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def intra_op_threads(job: Any, local: int | None = None) -> int:
    """``run.num_threads``, else a positive ``OMP_NUM_THREADS``, else this process's share of
    the available cores (``local`` processes on this host; default :func:`local_processes`)."""
    n = getattr(job.run, "num_threads", None)
    if n:
        return int(n)
    raw = os.environ.get("OMP_NUM_THREADS", "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return max(1, available_cores() // (local if local is not None else local_processes()))


@contextlib.contextmanager
def use_threads(n: int) -> Iterator[None]:
    """torch uses ``n`` intra-op threads in the block; the caller's count is put back after
    (``paratrain.fit`` runs in the user's own process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
