"""How many intra-op threads a training process gives torch (``torch.set_num_threads``).

Default: **one per process**, unless the job sets ``run.num_threads`` or the environment sets
``OMP_NUM_THREADS`` (the variable torch and torchrun read; torchrun sets it to 1 for its
workers). Why not torch's default (one thread per core): the models paratrain's examples
train are small (the GPT demo's matrices are 2048 x 64), so a step is many short kernels,
and torch's OpenMP threads wait for one another at the end of each; when the cores are
shared (a busy machine, or several paratrain workers on one), a thread that is descheduled
holds every kernel up. Measured on a 2-core machine (``benchmarks/RESULTS.md``, lifecycle):
under load the GPT demo's step took 0.12 s with 1 thread and 0.89 s with torch's default 2;
quiet, 2 threads were faster (0.043 s against 0.047 s). One thread bounds the loss on a
quiet machine and avoids the collapse on a shared one; a strategy's worker processes
already fill the cores; a Local run on a machine of one's own can ask for more with
``run.num_threads``. A fixed count also keeps a run's floating-point sums (and so its
parameters) the same on every machine, where a count taken from the core count would not.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["intra_op_threads", "use_threads"]


def intra_op_threads(job: Any) -> int:
    """``run.num_threads``, else a positive ``OMP_NUM_THREADS``, else 1."""
    n = getattr(job.run, "num_threads", None)
    if n:
        return int(n)
    raw = os.environ.get("OMP_NUM_THREADS", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


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
